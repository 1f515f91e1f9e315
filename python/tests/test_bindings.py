"""The C ABI that PyTorch and CuPy call (src/bindings.c), exercised through
ctypes on a simulated device served as "CUDA device 0": no GPU, no torch, no
CuPy needed. What torch and CuPy add on top is covered by tests/gpu/torch/.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gpumem  # noqa: E402
from gpumem import _core, _lib  # noqa: E402

MIB = 1 << 20

FAIL_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p)
OOM_OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)


class TorchAbiTest(unittest.TestCase):
    def setUp(self):
        self.lib = _lib.load()
        self.a = gpumem.Allocator("sim", capacity=1 << 30)
        gpumem.set_allocator(0, self.a)

    def tearDown(self):
        self.lib.gpumem_torch_set_fail_hook(None)
        gpumem.set_allocator(0, None)
        self.a.close()

    def test_malloc_free_through_torch_abi(self):
        lib = self.lib
        p = lib.gpumem_torch_malloc(3 * MIB, 0, None)
        q = lib.gpumem_torch_malloc(100, 0, ctypes.c_void_p(0x77))  # another stream
        self.assertTrue(p and q)
        s = self.a.memory_stats()
        self.assertEqual(s["allocation.all.current"], 2)
        self.assertEqual(s["requested_bytes.all.current"], 3 * MIB + 100)
        lib.gpumem_torch_free(p, 3 * MIB, 0, None)
        lib.gpumem_torch_free(q, 100, 0, ctypes.c_void_p(0x77))
        self.assertEqual(self.a.memory_stats()["allocation.all.current"], 0)
        self.assertEqual(self.a.check(), 0)
        # Zero bytes: NULL, nothing allocated, no failure recorded.
        self.assertIsNone(lib.gpumem_torch_malloc(0, 0, None))
        lib.gpumem_torch_free(None, 0, 0, None)

    def test_hooks(self):
        lib = self.lib
        p = lib.gpumem_torch_malloc(5 * MIB, 0, None)
        size = ctypes.c_size_t(0)
        self.assertEqual(lib.gpumem_torch_base_alloc(p, ctypes.byref(size)), p)
        self.assertEqual(size.value, 5 * MIB)
        lib.gpumem_torch_record_stream(p, ctypes.c_void_p(0x99))
        lib.gpumem_torch_free(p, 5 * MIB, 0, None)
        self.assertEqual(self.a.check(), 0)
        lib.gpumem_torch_init(1)
        self.assertGreater(self.a.memory_stats()["reserved_bytes.all.current"], 0)
        lib.gpumem_torch_reset()  # torch.cuda.empty_cache
        self.assertEqual(self.a.memory_stats()["reserved_bytes.all.current"], 0)
        lib.gpumem_torch_set_memory_fraction(0.5, 0)
        self.assertEqual(self.a.get_limit(), 1 << 29)
        self.assertEqual(lib.gpumem_torch_empty_cache(0), 0)
        self.assertEqual(lib.gpumem_torch_empty_cache(-1), 0)

    def test_oom_report_is_kept_per_thread(self):
        lib = self.lib
        self.a.set_limit("32M")
        self.assertIsNone(lib.gpumem_torch_malloc(64 * MIB, 0, None))
        self.assertEqual(lib.gpumem_torch_last_status(), gpumem.errors.ERR_OUT_OF_MEMORY)
        report = lib.gpumem_torch_last_oom().decode()
        self.assertIn("out of memory", report)
        self.assertIn("Limit: 32.00 MiB", report)
        # A later unrelated failure does not replace it.
        with self.assertRaises(gpumem.InvalidPointerError):
            self.a.free(0x1234)
        self.assertEqual(lib.gpumem_torch_last_oom().decode(), report)
        # Another thread has its own (empty) report.
        import threading

        seen = []
        t = threading.Thread(target=lambda: seen.append(lib.gpumem_torch_last_oom()))
        t.start()
        t.join()
        self.assertEqual(seen, [b""])

    def _torch_size(self, n):
        # c10's format_size, written out independently of the C code
        if n <= 1024:
            return "%d bytes" % n
        for limit, div, unit in ((1 << 20, 1024.0, "KiB"), (1 << 30, float(1 << 20), "MiB")):
            if n <= limit:
                return "%.2f %s" % (n / div, unit)
        return "%.2f GiB" % (n / float(1 << 30))

    def test_oom_message_opens_as_pytorchs(self):
        lib = self.lib
        self.a.set_limit("32M")
        keep = [lib.gpumem_torch_malloc(8 * MIB, 0, None), lib.gpumem_torch_malloc(3 * MIB, 0, None)]
        try:
            self.assertIsNone(lib.gpumem_torch_malloc(40 * MIB, 0, None))
            report = lib.gpumem_torch_last_oom().decode()
            s = self.a.memory_stats()
            expected = (
                "CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 1024.00 MiB "
                "of which %s is free. 32.00 MiB allowed; Of the allocated memory %s is allocated by "
                "PyTorch, and %s is reserved by PyTorch but unallocated. gpumem: out of memory: tried to "
                "allocate 40.00 MiB"
                % (
                    self._torch_size(s["device_free"]),
                    self._torch_size(s["allocated_bytes.all.current"]),
                    self._torch_size(s["reserved_bytes.all.current"] - s["allocated_bytes.all.current"]),
                )
            )
            self.assertTrue(report.startswith(expected), report)
            # What Accelerate's and Lightning's finders look for.
            self.assertIn("CUDA out of memory.", report)
        finally:
            for p in keep:
                lib.gpumem_torch_free(p, 0, 0, None)

    def test_oom_message_follows_the_torch_version(self):
        lib = self.lib
        self.a.set_limit("4M")
        try:
            lib.gpumem_torch_set_version(2, 1)
            self.assertIsNone(lib.gpumem_torch_malloc(64 * MIB, 0, None))
            self.assertIn("has a total capacty of", lib.gpumem_torch_last_oom().decode())
            lib.gpumem_torch_set_version(2, 5)
            self.assertIsNone(lib.gpumem_torch_malloc(64 * MIB, 0, None))
            self.assertIn("has a total capacity of", lib.gpumem_torch_last_oom().decode())
        finally:
            lib.gpumem_torch_set_version(2, 11)

    def test_segment_size_is_pytorchs(self):
        seg = self.lib.gpumem_torch_segment_size
        self.assertEqual(seg(1), 2 * MIB)
        self.assertEqual(seg(MIB), 2 * MIB)
        self.assertEqual(seg(MIB + 1), 20 * MIB)
        self.assertEqual(seg(10 * MIB - 512), 20 * MIB)
        self.assertEqual(seg(10 * MIB), 10 * MIB)
        self.assertEqual(seg(11 * MIB), 12 * MIB)
        self.assertEqual(seg(12 * MIB + 1), 14 * MIB)

    def test_hundred_failed_trials_leave_nothing_behind(self):
        # A batch-size finder's trials: some tensors fit, the next does not,
        # the trial unwinds and frees them; the observer sees every failure.
        lib = self.lib
        seen = []
        obs = OOM_OBSERVER(lambda dev, size, allowed, free: seen.append((dev, size, allowed, free)))
        self._keep_obs = obs
        lib.gpumem_torch_set_oom_observer(ctypes.cast(obs, ctypes.c_void_p))
        self.a.set_limit("64M")
        base = self.a.memory_stats()
        try:
            for trial in range(100):
                held = []
                size = (trial % 7 + 1) * MIB
                while True:
                    p = lib.gpumem_torch_malloc(size, 0, None)
                    if not p:
                        break
                    held.append(p)
                self.assertTrue(lib.gpumem_torch_last_oom().decode().startswith("CUDA out of memory."))
                for p in held:
                    lib.gpumem_torch_free(p, 0, 0, None)
                self.assertEqual(self.a.check(), 0)
            s = self.a.memory_stats()
            self.assertEqual(s["num_ooms"] - base["num_ooms"], 100)
            self.assertEqual(len(seen), 100)
            self.assertTrue(all(d == 0 and allowed == 64 * MIB for d, _, allowed, _ in seen))
            self.assertEqual(s["allocated_bytes.all.current"], 0)
            self.assertEqual(s["allocation.all.current"], 0)
            # and the memory goes back to the device when asked
            self.assertEqual(lib.gpumem_torch_empty_cache(0), 0)
            self.assertEqual(self.a.memory_stats()["reserved_bytes.all.current"], 0)
        finally:
            lib.gpumem_torch_set_oom_observer(None)

    def test_fail_hook_gets_the_report(self):
        lib = self.lib
        calls = []

        @FAIL_HOOK
        def hook(func, file, line, msg):
            calls.append((func.decode(), msg.decode()))

        self._keep = hook
        lib.gpumem_torch_set_fail_hook(ctypes.cast(hook, ctypes.c_void_p))
        self.a.set_limit("16M")
        self.assertIsNone(lib.gpumem_torch_malloc(32 * MIB, 0, None))
        self.assertEqual(len(calls), 1)
        self.assertEqual(calls[0][0], "gpumem_torch_malloc")
        self.assertIn("out of memory", calls[0][1])
        # Success never calls it.
        p = lib.gpumem_torch_malloc(MIB, 0, None)
        self.assertEqual(len(calls), 1)
        lib.gpumem_torch_free(p, MIB, 0, None)

    def test_bad_free_is_reported_not_fatal(self):
        # Runs in a child: the report goes to stderr, which we read.
        code = (
            "import sys, ctypes; sys.path.insert(0, %r)\n"
            "import gpumem\n"
            "from gpumem import _lib\n"
            "a = gpumem.Allocator('sim', capacity=1 << 30)\n"
            "gpumem.set_allocator(0, a)\n"
            "_lib.load().gpumem_torch_free(ctypes.c_void_p(0x1234), 8, 0, None)\n"
            "print('alive')\n"
        ) % os.path.dirname(HERE)
        proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("alive", proc.stdout)
        self.assertIn("gpumem: free of 0x1234 on CUDA device 0 failed", proc.stderr)

    def test_cupy_abi(self):
        lib = self.lib
        p = lib.gpumem_cupy_malloc(None, 2 * MIB, 0)
        self.assertTrue(p)
        self.assertEqual(self.a.memory_stats()["allocation.all.current"], 1)
        lib.gpumem_cupy_free(None, p, 0)
        # param: an explicit allocator.
        with gpumem.Allocator("sim", capacity=1 << 28) as other:
            q = lib.gpumem_cupy_malloc(other.handle, MIB, 0)
            self.assertEqual(other.memory_stats()["allocation.all.current"], 1)
            lib.gpumem_cupy_free(other.handle, q, 0)
            self.assertIsNone(lib.gpumem_cupy_malloc(other.handle, 1 << 30, 0))
            self.assertEqual(lib.gpumem_torch_last_status(), gpumem.errors.ERR_OUT_OF_MEMORY)
        self.assertEqual(self.a.memory_stats()["allocation.all.current"], 0)

    def test_stats_text_helpers(self):
        lib = self.lib
        # A tiny buffer: the helper says how much it needs and truncates safely.
        buf = ctypes.create_string_buffer(8)
        need = lib.gpumem_binding_stats_json(self.a.handle, buf, 8)
        self.assertGreater(need, 8)
        self.assertEqual(len(buf.value), 7)
        zero = _core.flatten_stats(
            __import__("json").loads(_lib.read_text(lib.gpumem_binding_stats_json, None))
        )
        self.assertEqual(zero["reserved_bytes.all.current"], 0)
        self.assertIn("GPU reserved memory", _lib.read_text(lib.gpumem_binding_summary, None))

    def test_device_out_of_range(self):
        self.assertIsNone(self.lib.gpumem_binding_allocator(64))
        self.assertIn("out of range", gpumem.last_error())
        self.assertIsNone(self.lib.gpumem_torch_malloc(10, 64, None))
        self.assertEqual(self.lib.gpumem_torch_last_status(), gpumem.errors.ERR_BACKEND)
        self.assertIn("no allocator for CUDA device 64", self.lib.gpumem_torch_last_oom().decode())


_CXX_TEST = r"""
// A C++ exception thrown by the fail hook must unwind through the C frame
// of gpumem_torch_malloc to the caller: the no-compiler fallback for PyTorch
// relies on it (the hook there is c10::detail::torchCheckFail).
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <sys/types.h>
extern "C" {
typedef void (*fail_fn)(const char*, const char*, uint32_t, const char*);
void* gpumem_torch_malloc(ssize_t, int, void*);
void gpumem_torch_set_fail_hook(fail_fn);
void* gpumem_sim_create(const void*);
void* gpumem_create(void*, const void*, int*);
int gpumem_binding_set_allocator(int, void*);
void gpumem_destroy(void*);
}
static void thrower(const char* func, const char*, uint32_t, const char* msg) {
  throw std::runtime_error(std::string(func) + ": " + msg);
}
int main() {
  void* be = gpumem_sim_create(nullptr);
  void* gm = gpumem_create(be, nullptr, nullptr);
  if (!gm || gpumem_binding_set_allocator(0, gm) != 0) return 2;
  gpumem_torch_set_fail_hook(thrower);
  void* ok = gpumem_torch_malloc(1 << 20, 0, nullptr);
  if (!ok) return 3;
  try {
    gpumem_torch_malloc((ssize_t)1 << 50, 0, nullptr);
  } catch (const std::exception& e) {
    std::printf("caught %s\n", e.what());
    return 0;
  }
  return 4;
}
"""


class UnwindTest(unittest.TestCase):
    def test_cxx_exception_unwinds_through_malloc(self):
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if not cxx:
            self.skipTest("no C++ compiler")
        libdir = os.path.dirname(_lib.path())
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "unwind.cpp")
            exe = os.path.join(tmp, "unwind")
            with open(src, "w") as f:
                f.write(_CXX_TEST)
            build = subprocess.run(
                [cxx, "-O2", src, "-o", exe, "-L" + libdir, "-lgpumem", "-Wl,-rpath," + libdir],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            if build.returncode != 0:
                self.skipTest("cannot link a C++ program against %s: %s" % (_lib.path(), build.stdout[-500:]))
            run = subprocess.run([exe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.assertEqual(run.returncode, 0, run.stdout)
        self.assertIn("caught gpumem_torch_malloc: CUDA out of memory. Tried to allocate", run.stdout)
        self.assertIn("gpumem: out of memory", run.stdout)


if __name__ == "__main__":
    unittest.main()
