"""CUDA graphs, torch.compile's reduce-overhead mode, cuDNN's benchmark mode,
MemPool, snapshots and IPC under gpumem, each against native PyTorch (same
seeds) in fresh processes (graphs_child.py)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import json  # noqa: E402
import subprocess  # noqa: E402

import test_torch_gpumem as base  # noqa: E402

CHILD = os.path.join(base.HERE, "graphs_child.py")


def run_child(workload, *args):
    cmd = [sys.executable, CHILD, workload] + list(args)
    proc = subprocess.run(cmd, env=base._env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError("%s failed (exit %d)\n--- stderr\n%s" % (" ".join(cmd), proc.returncode, proc.stderr[-6000:]))
    result = json.loads(lines[-1])
    if "error" in result:
        raise AssertionError("%s: %s\n--- stderr\n%s" % (workload, result["error"], proc.stderr[-4000:]))
    return result


def both(workload, *args):
    return run_child(workload, "--allocator", "native", *args), run_child(workload, "--allocator", "gpumem", *args)


def build_pool_allocator():
    """pool_allocator.cu as a shared library (nvcc), in a temporary directory."""
    import shutil
    import tempfile

    nvcc = shutil.which("nvcc")
    if not nvcc:
        from torch.utils import cpp_extension

        home = getattr(cpp_extension, "CUDA_HOME", None)
        nvcc = os.path.join(home, "bin", "nvcc") if home else None
    if not nvcc or not os.path.exists(nvcc):
        raise unittest.SkipTest("nvcc not found: cannot build the pool's allocator")
    out = os.path.join(tempfile.mkdtemp(prefix="gpumem-pool-alloc-"), "pool_allocator.so")
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-o", out, os.path.join(base.HERE, "pool_allocator.cu")],
                   check=True, capture_output=True, text=True)
    return out


def close(a, b, rel=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= rel * max(1.0, abs(x)) for x, y in zip(a, b))


class GraphsTest(unittest.TestCase):
    def setUp(self):
        base.need()

    def test_cuda_graph(self):
        n, g = both("graph")
        self.assertEqual(n["sums"], g["sums"])
        # the graph's pool is counted while it lives and gone after
        self.assertGreater(g["during"]["reserved"], g["before"]["reserved"])
        self.assertEqual(g["after"]["allocated"], g["before"]["allocated"])
        self.assertLessEqual(g["after"]["reserved"], g["before"]["reserved"])

    def test_make_graphed_callables(self):
        n, g = both("graphed_callables")
        self.assertEqual(n["losses"], g["losses"])

    def test_reduce_overhead_inference(self):
        n, g = both("compile", "--mode", "infer")
        self.assertTrue(close(n["values"], g["values"]), (n["values"], g["values"]))

    def test_reduce_overhead_training(self):
        n, g = both("compile", "--mode", "train")
        self.assertTrue(close(n["values"], g["values"]), (n["values"], g["values"]))

    def test_cudnn_benchmark(self):
        n, g = both("cudnn")
        self.assertTrue(g["benchmark"], "benchmark mode was kept off")
        self.assertTrue(close(n["sums"], g["sums"], 1e-3), (n["sums"], g["sums"]))

    def test_mempool(self):
        n, g = both("mempool")
        self.assertEqual(n["total"], g["total"])
        self.assertEqual(g["after"]["allocated"], g["before"]["allocated"])
        self.assertLessEqual(g["after"]["reserved"], g["before"]["reserved"])

    def test_mempool_no_split(self):
        n, g = both("mempool_no_split")
        self.assertEqual(n["total"], g["total"])
        for r in (n, g):  # native's behaviour is the reference
            self.assertEqual(r["segments_made"], r["allocations"], r)
            self.assertTrue(r["reused_whole"], r)

    def test_mempool_allocator(self):
        lib = build_pool_allocator()
        n, g = both("mempool_allocator", "--lib", lib)
        print("mempool_allocator: segments from the pool's allocator, native %s, gpumem %s (bytes); freed %d/%d "
              "and %d/%d" % (n["segments"], g["segments"], n["frees"], n["mallocs"], g["frees"], g["mallocs"]),
              file=sys.stderr)
        self.assertEqual(n["total"], g["total"])
        for r in (n, g):  # native's behaviour is the reference
            self.assertTrue(all(r["inside"]), r)
            self.assertTrue(r["outside"], r)
            self.assertGreater(r["mallocs"], 0, r)
            self.assertEqual(r["frees"], r["mallocs"], r)
            self.assertEqual(r["live_after"], 0, r)
        # the same segments (PyTorch's sizes), all counted as reserved memory
        self.assertEqual(g["segments"], n["segments"])
        self.assertEqual(g["pool_reserved"], n["pool_reserved"])
        self.assertEqual(g["pool_reserved"], sum(g["segments"]))

    def test_mempool_use_on_oom(self):
        n, g = both("mempool_use_on_oom")
        for r in (n, g):
            self.assertTrue(r["with"]["ok"], r)
            self.assertTrue(r["with"]["in_pool_block"], r)
            self.assertEqual(r["with"]["sum"], 128 << 20)
            self.assertFalse(r["without"]["ok"], r)

    def test_snapshot(self):
        r = run_child("snapshot", "--allocator", "gpumem")
        self.assertGreater(r["segments"], 0)
        print("snapshot: python frames under gpumem: %d, C++ frames %d (in the test's function: %d blocks, "
              "%d events)" % (r["python_frames"], r["cpp_frames"], r["frames_here"], r["events_here"]),
              file=sys.stderr)
        self.assertGreater(r["cpp_frames"], 0)
        # x and y were allocated in w_snapshot: their blocks and alloc events carry its frame
        self.assertGreaterEqual(r["frames_here"], 2)
        self.assertGreaterEqual(r["events_here"], 2)
        self.assertGreater(r["viz_bytes"], 0)

    def test_ipc(self):
        # a CUDA tensor through a torch.multiprocessing queue, gpumem in both
        # processes: the receiver maps the sender's pages (file descriptors)
        r = run_child("ipc", "--allocator", "gpumem")
        self.assertTrue(r["shared"], r.get("message"))
        self.assertTrue(r["child_gpumem"])
        self.assertEqual(r["sum"], r["expected"])
        self.assertEqual(r["exitcode"], 0)


if __name__ == "__main__":
    unittest.main()
