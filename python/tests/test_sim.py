"""The Python package on the simulated device: no GPU, standard library only.

Run from the repository root:
    GPUMEM_LIBRARY=build/libgpumem.so python3 -m unittest discover -s python/tests -v
"""

import gc
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/, where the package lives

import gpumem  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30

# torch.cuda.memory_stats()'s keys (PyTorch 2.x): the statistic arrays for
# each pool and metric, and the event counters.
TORCH_ARRAYS = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
]
TORCH_COUNTERS = [
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
]
TORCH_KEYS = [
    "%s.%s.%s" % (a, pool, metric)
    for a in TORCH_ARRAYS
    for pool in ("all", "large_pool", "small_pool")
    for metric in ("current", "peak", "allocated", "freed")
] + TORCH_COUNTERS


def sim(**kw):
    kw.setdefault("capacity", 1 * GIB)
    return gpumem.Allocator("sim", **kw)


class LibraryTest(unittest.TestCase):
    def test_loads_and_reports_path(self):
        path = gpumem.library_path()
        self.assertTrue(os.path.isabs(path), path)
        self.assertTrue(os.path.exists(path), path)

    def test_missing_library_lists_every_place(self):
        # A fresh interpreter: this one has the library loaded already.
        code = (
            "import sys; sys.path.insert(0, %r)\n"
            "import gpumem\n"
            "try:\n"
            "    gpumem.load_library()\n"
            "except gpumem.LibraryNotFoundError as e:\n"
            "    print('RAISED'); print(e)\n"
            "    assert isinstance(e, ImportError) and isinstance(e, gpumem.GpumemError)\n"
        ) % os.path.dirname(HERE)
        env = dict(os.environ, GPUMEM_LIBRARY="/nonexistent/libgpumem.so")
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ).stdout
        self.assertIn("RAISED", out)
        self.assertIn("/nonexistent/libgpumem.so", out)
        self.assertIn("GPUMEM_LIBRARY", out)

    def test_library_of_another_version_is_refused(self):
        from gpumem import _lib

        self.assertEqual(_lib.load().gpumem_version(), _lib.ABI_VERSION)
        saved = _lib.ABI_VERSION
        _lib.ABI_VERSION = saved + 1
        try:
            lib, why = _lib._try(_lib.path())
        finally:
            _lib.ABI_VERSION = saved
        self.assertIsNone(lib)
        self.assertIn("is gpumem 0.1, this package is %s" % gpumem.__version__, why)

    def test_library_without_version_is_refused(self):
        import ctypes.util

        from gpumem import _lib

        other = ctypes.util.find_library("z") or ctypes.util.find_library("m")
        if not other:
            self.skipTest("no libz or libm to load")
        lib, why = _lib._try(other)
        self.assertIsNone(lib)
        self.assertIn("no gpumem_version", why)

    def test_not_found_anywhere_lists_candidates(self):
        from gpumem import _lib

        # Every candidate the loader would try, in order, named with why.
        old = os.environ.get("GPUMEM_LIBRARY")
        os.environ["GPUMEM_LIBRARY"] = "/x/libgpumem.so"
        try:
            hows = [how for _path, how in _lib.candidates()]
        finally:
            if old is None:
                del os.environ["GPUMEM_LIBRARY"]
            else:
                os.environ["GPUMEM_LIBRARY"] = old
        self.assertEqual(
            hows, ["GPUMEM_LIBRARY", "inside the package", "source checkout build tree", "system library path"]
        )


class ConfigTest(unittest.TestCase):
    def test_unknown_key_names_it(self):
        with self.assertRaises(gpumem.ConfigError) as cm:
            sim(conf="bogus:1")
        self.assertIn("bogus", str(cm.exception))
        self.assertIsInstance(cm.exception, ValueError)
        self.assertEqual(cm.exception.status, gpumem.errors.ERR_CONFIG)

    def test_bad_value_names_key(self):
        for conf, key in (
            ("limit:lots", "limit"),
            ("policy:fastest", "policy"),
            ("fraction:2", "fraction"),
            ("move_guard:maybe", "move_guard"),
        ):
            with self.subTest(conf=conf):
                with self.assertRaises(gpumem.ConfigError) as cm:
                    gpumem.check_conf(conf)
                self.assertIn(key, str(cm.exception))

    def test_good_conf(self):
        gpumem.check_conf("policy:pytorch,limit:2G")
        with sim(conf="policy:pytorch") as a:
            p = a.malloc(MIB)
            a.free(p)
            self.assertEqual(a.check(), 0)

    def test_move_guard_counter(self):
        # the key is accepted and its counter reported, 0 while pages do not keep moving
        with sim(conf="move_guard:off") as a:
            p = a.malloc(MIB)
            a.free(p)
            self.assertEqual(a.memory_stats()["num_move_guard_trips"], 0)

    def test_parse_size(self):
        self.assertEqual(gpumem.parse_size("4K"), 4096)
        self.assertEqual(gpumem.parse_size("1.5G"), 3 * GIB // 2)
        with self.assertRaises(gpumem.GpumemError):
            gpumem.parse_size("many")


class AllocatorTest(unittest.TestCase):
    def setUp(self):
        self.a = sim()

    def tearDown(self):
        self.a.close()

    def assertInvariants(self, a=None):
        a = a or self.a
        self.assertEqual(a.check(), 0, gpumem.last_error())
        s = a.memory_stats()
        self.assertLessEqual(s["requested_bytes.all.current"], s["allocated_bytes.all.current"])
        self.assertLessEqual(s["allocated_bytes.all.current"], s["active_bytes.all.current"])
        # (blocks of the overflow tier on host pages are active, not reserved)
        self.assertLessEqual(
            s["active_bytes.all.current"], s["reserved_bytes.all.current"] + s["host_bytes.all.current"]
        )
        return s

    def test_malloc_free_stats(self):
        ptrs = [self.a.malloc(n) for n in (1, 1000, MIB, 3 * MIB + 5, 64 * MIB)]
        self.assertEqual(len(set(ptrs)), len(ptrs))
        self.assertTrue(all(p > 0 for p in ptrs))
        s = self.assertInvariants()
        self.assertEqual(s["allocation.all.current"], 5)
        self.assertEqual(s["requested_bytes.all.current"], 1 + 1000 + MIB + 3 * MIB + 5 + 64 * MIB)
        self.assertEqual(self.a.allocation_size(ptrs[1]), 1000)
        for p in ptrs:
            self.a.free(p)
            self.assertInvariants()
        s = self.a.memory_stats()
        self.assertEqual(s["allocated_bytes.all.current"], 0)
        self.assertEqual(s["allocation.all.allocated"], 5)
        self.assertEqual(s["allocation.all.freed"], 5)
        self.assertGreaterEqual(s["allocated_bytes.all.peak"], 68 * MIB)

    def test_zero_and_null(self):
        self.assertEqual(self.a.malloc(0), 0)
        self.a.free(0)
        self.assertEqual(self.a.memory_stats()["allocation.all.current"], 0)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.malloc(-1)

    def test_keys_match_torch_vocabulary(self):
        self.a.free(self.a.malloc(MIB))
        s = self.a.memory_stats()
        missing = [k for k in TORCH_KEYS if k not in s]
        self.assertEqual(missing, [])
        for k in TORCH_KEYS:
            self.assertIsInstance(s[k], int, k)
        # gpumem's own figures ride along.
        for k in ("largest_free_block", "fragmentation", "device_total", "backend_calls.map"):
            self.assertIn(k, s)
        self.assertEqual(s["device_total"], GIB)

    def test_summary(self):
        p = self.a.malloc(5 * MIB)
        text = self.a.memory_summary()
        for row in ("Allocated memory", "GPU reserved memory", "from large pool", "Fragmentation"):
            self.assertIn(row, text)
        self.a.free(p)

    def test_oom_under_limit_carries_report(self):
        self.a.set_limit("64M")
        self.assertEqual(self.a.get_limit(), 64 * MIB)
        keep = self.a.malloc(40 * MIB)
        with self.assertRaises(gpumem.OutOfMemoryError) as cm:
            self.a.malloc(40 * MIB)
        e = cm.exception
        self.assertIsInstance(e, MemoryError)
        self.assertIsInstance(e, gpumem.GpumemError)
        self.assertEqual(e.status, gpumem.errors.ERR_OUT_OF_MEMORY)
        text = str(e)
        self.assertIn("out of memory", text)
        self.assertIn("Limit: 64.00 MiB", text)
        self.assertIn("Advice", text)
        self.assertEqual(self.a.memory_stats()["num_ooms"], 1)
        self.assertInvariants()
        # The classic recovery: free, retry smaller.
        self.a.free(keep)
        p = self.a.malloc(20 * MIB)
        self.assertInvariants()
        self.a.free(p)
        self.a.remove_limit()
        self.assertEqual(self.a.get_limit(), 0)
        self.a.free(self.a.malloc(200 * MIB))

    def test_limit_fraction(self):
        self.a.set_limit_fraction(0.5)
        self.assertEqual(self.a.get_limit(), GIB // 2)
        with self.assertRaises(gpumem.OutOfMemoryError):
            self.a.malloc(600 * MIB)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.set_limit_fraction(1.5)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.set_limit(0)

    def test_device_capacity_oom(self):
        with self.assertRaises(gpumem.OutOfMemoryError) as cm:
            self.a.malloc(2 * GIB)
        self.assertIn("1.00 GiB total", str(cm.exception))

    def test_bad_pointers(self):
        p = self.a.malloc(MIB)
        with self.assertRaises(gpumem.InvalidPointerError) as cm:
            self.a.free(p + 512)
        self.assertIn("into the allocation", str(cm.exception))
        with self.assertRaises(gpumem.InvalidPointerError):
            self.a.free(0x1234)
        self.a.free(p)
        with self.assertRaises(gpumem.InvalidPointerError) as cm:
            self.a.free(p)
        self.assertIsInstance(cm.exception, ValueError)
        with self.assertRaises(gpumem.InvalidPointerError):
            self.a.record_stream(0x1234, 7)
        self.assertInvariants()

    def test_streams_and_record_stream(self):
        p = self.a.malloc(MIB, stream=1)
        q = self.a.malloc(MIB, stream=2)
        self.a.record_stream(p, 2)
        self.a.free(p)
        self.a.free(q)
        self.assertInvariants()
        self.assertEqual(self.a.memory_stats()["allocation.all.current"], 0)
        with self.assertRaises(TypeError):
            self.a.malloc(10, stream="default")

    def test_reset_peak_and_accumulated(self):
        p = self.a.malloc(32 * MIB)
        self.a.free(p)
        s = self.a.memory_stats()
        self.assertGreaterEqual(s["allocated_bytes.all.peak"], 32 * MIB)
        self.a.reset_peak_stats()
        self.assertEqual(self.a.memory_stats()["allocated_bytes.all.peak"], 0)
        self.a.reset_accumulated_stats()
        self.assertEqual(self.a.memory_stats()["allocation.all.allocated"], 0)

    def test_empty_cache_returns_memory(self):
        ptrs = [self.a.malloc(8 * MIB) for _ in range(4)]
        for p in ptrs:
            self.a.free(p)
        self.a.empty_cache()
        s = self.assertInvariants()
        self.assertEqual(s["reserved_bytes.all.current"], 0)

    def test_host_backed_contents(self):
        with sim(host_backed=True) as a:
            p = a.malloc(4096)
            view = a.host_view(p, 4096)
            view[:4] = b"gpum"
            self.assertEqual(bytes(a.host_view(p, 4)), b"gpum")
            a.free(p)
        with self.assertRaises(gpumem.UnsupportedError):
            gpumem.Allocator._wrap(self.a.handle, 0).host_view(1, 1)

    def test_overflow_tier(self):
        # overflow:host: past the limit a request gets host pages at an
        # address of its own; memory_stats and the summary show it; the
        # hint moves it; empty_cache brings back what did not take the hint.
        with sim(conf="overflow:host:64M,limit:32M", host_backed=True) as a:
            ptrs = [a.malloc(8 * MIB) for _ in range(4)]
            over = a.malloc(8 * MIB)
            a.host_view(over, 4)[:4] = b"tier"
            s = self.assertInvariants(a)
            self.assertEqual(s["host_bytes.all.current"], 8 * MIB)
            self.assertEqual(s["num_host_allocs"], 1)
            self.assertLessEqual(s["reserved_bytes.all.current"], 32 * MIB)
            self.assertIn("Host-backed memory", a.memory_summary())
            # an arena block that owns whole pages takes the hint too: its
            # pages move now (nothing waits), and go with its free
            a.host_view(ptrs[0], 5)[:5] = b"arena"
            self.assertTrue(a.prefer_host(ptrs[0]))
            s = self.assertInvariants(a)
            self.assertEqual(s["num_moves_to_host"], 1)
            self.assertEqual(bytes(a.host_view(ptrs[0], 5)), b"arena")
            for p in ptrs:
                a.free(p)
            a.empty_cache()
            s = self.assertInvariants(a)
            self.assertEqual(s["num_moves_to_device"], 1)
            self.assertEqual(s["host_bytes.all.current"], 0)
            self.assertEqual(bytes(a.host_view(over, 4)), b"tier")
            self.assertTrue(a.prefer_host(over))
            s = self.assertInvariants(a)
            self.assertEqual(s["num_moves_to_host"], 2)
            self.assertEqual(bytes(a.host_view(over, 4)), b"tier")
            with self.assertRaises(gpumem.OutOfMemoryError) as cm:
                a.malloc(60 * MIB)
            self.assertIn("the host budget is spent too", str(cm.exception))
            a.free(over)
        with sim(conf="overflow:host", host_backed=True) as a:
            p = a.malloc(MIB)
            try:
                self.assertFalse(a.prefer_host(p))  # owns no whole page: cannot move
            finally:
                a.free(p)
        with self.assertRaises(gpumem.UnsupportedError):
            p = self.a.malloc(MIB)
            try:
                self.a.prefer_host(p)
            finally:
                self.a.free(p)

    def test_injected_device_failure(self):
        # Every later device call fails: the allocation must fail cleanly,
        # with a report, and leave consistent structures.
        self.a.sim_fail(kind=-1, skip=0, count=-1)
        with self.assertRaises(gpumem.OutOfMemoryError):
            self.a.malloc(16 * MIB)
        self.a.sim_fail_clear()
        self.assertInvariants()
        self.a.free(self.a.malloc(16 * MIB))

    def test_close_and_context_manager(self):
        with sim() as a:
            a.malloc(MIB)  # live at close: freed with the allocator
        self.assertTrue(a.closed)
        with self.assertRaises(ValueError):
            a.malloc(1)
        a.close()  # twice is fine
        b = sim()
        del b
        gc.collect()

    def test_torch_stream_objects_accepted(self):
        class FakeTorchStream:
            cuda_stream = 5

        class FakeCupyStream:
            ptr = 6

        p = self.a.malloc(10, stream=FakeTorchStream())
        self.a.record_stream(p, FakeCupyStream())
        self.a.free(p)

    def test_cuda_device_without_gpu(self):
        # This machine may have no driver: creating must fail cleanly, or
        # (on a GPU machine) work.
        try:
            a = gpumem.Allocator(0)
        except gpumem.GpumemError as e:
            self.assertTrue(str(e))
        else:
            a.free(a.malloc(MIB))
            a.close()


class ModuleFunctionsTest(unittest.TestCase):
    """The torch.cuda-shaped functions over the per-device allocators."""

    def setUp(self):
        self.a = sim()
        gpumem.set_allocator(0, self.a)

    def tearDown(self):
        gpumem.set_allocator(0, None)
        self.a.close()

    def test_functions_follow_the_served_allocator(self):
        p = self.a.malloc(10 * MIB)
        self.assertEqual(gpumem.memory_allocated(0), self.a.memory_stats()["allocated_bytes.all.current"])
        self.assertGreaterEqual(gpumem.memory_reserved(0), gpumem.memory_allocated(0))
        self.assertGreaterEqual(gpumem.max_memory_allocated("cuda:0"), 10 * MIB)
        self.assertGreaterEqual(gpumem.max_memory_reserved(), gpumem.memory_reserved())
        self.a.free(p)
        gpumem.reset_peak_memory_stats(0)
        self.assertEqual(gpumem.max_memory_allocated(0), 0)
        gpumem.empty_cache()
        self.assertEqual(gpumem.memory_reserved(0), 0)
        self.assertIn("GPU reserved memory", gpumem.memory_summary(0))
        free, total = gpumem.mem_get_info(0)
        self.assertEqual(total, GIB)
        self.assertLessEqual(free, total)

    def test_fraction(self):
        gpumem.set_per_process_memory_fraction(0.25, 0)
        self.assertAlmostEqual(gpumem.get_per_process_memory_fraction(0), 0.25)
        with self.assertRaises(gpumem.OutOfMemoryError):
            self.a.malloc(300 * MIB)
        with self.assertRaises(ValueError):
            gpumem.set_per_process_memory_fraction(1.5, 0)
        with self.assertRaises(TypeError):
            gpumem.set_per_process_memory_fraction("half", 0)
        self.a.remove_limit()

    def test_unused_device_reports_zeros_without_creating(self):
        s = gpumem.memory_stats(7)
        self.assertEqual(s["allocated_bytes.all.current"], 0)
        self.assertEqual(gpumem.memory_reserved(7), 0)
        gpumem.reset_peak_memory_stats(7)  # nothing to reset: no error
        from gpumem import _lib

        self.assertFalse(_lib.load().gpumem_binding_peek(7))

    def test_device_index_forms(self):
        class TorchDevice:
            type = "cuda"
            index = 3

        class CupyDevice:
            id = 2

        self.assertEqual(gpumem.device_index(1), 1)
        self.assertEqual(gpumem.device_index("cuda:4"), 4)
        self.assertEqual(gpumem.device_index(TorchDevice()), 3)
        self.assertEqual(gpumem.device_index(CupyDevice()), 2)
        with self.assertRaises(TypeError):
            gpumem.device_index(True)

    def test_set_allocator_refused_with_live_allocations(self):
        p = self.a.malloc(MIB)
        with sim() as other:
            with self.assertRaises(gpumem.InvalidArgumentError) as cm:
                gpumem.set_allocator(0, other)
            self.assertIn("live allocation", str(cm.exception))
        self.a.free(p)


if __name__ == "__main__":
    unittest.main()
