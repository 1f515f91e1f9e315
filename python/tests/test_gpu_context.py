"""gpumem.predict.gpu_context: the CUDA context a recording on the GPU
measures is this process's own, not the memory other processes on the same
GPU hold. The attribution from NVML's process lists runs anywhere; the
measurement itself, with another process holding 2 GiB, on a GPU."""

import os
import subprocess
import sys
import textwrap
import unittest

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
sys.path.insert(0, PYTHON_DIR)

from gpumem.predict import gpu_context  # noqa: E402

GIB = 1 << 30


class AttributeTest(unittest.TestCase):
    def test_own_process_is_the_new_entry(self):
        before = {11: 4 * GIB}
        now = {11: 4 * GIB, 42: 600 << 20}
        got, how = gpu_context.attribute(before, now, reserved=100 << 20, in_use=4 * GIB + (500 << 20))
        self.assertEqual(got, 500 << 20)
        self.assertIn("4.000 GiB of other processes on the GPU not counted", how)

    def test_alone(self):
        got, how = gpu_context.attribute({}, {7: 700 << 20}, reserved=64 << 20, in_use=636 << 20)
        self.assertEqual((got, how), (636 << 20, "measured"))

    def test_no_nvml_says_what_is_counted(self):
        got, how = gpu_context.attribute(None, None, reserved=0, in_use=5 * GIB)
        self.assertEqual(got, 5 * GIB)
        self.assertIn("every process's; NVML not available", how)

    def test_ambiguous_lists_fall_back_by_name(self):
        # two processes started during the run: which one is this?
        got, how = gpu_context.attribute({}, {1: GIB, 2: GIB}, reserved=0, in_use=3 * GIB)
        self.assertEqual(got, 3 * GIB)
        self.assertIn("could not tell this process from the others (2 listed)", how)
        # NVML without per-process memory (some virtualised GPUs)
        got, how = gpu_context.attribute({}, {1: None}, reserved=0, in_use=GIB)
        self.assertIn("could not tell", how)
        # a GPU NVML does not list
        self.assertIn("does not list this GPU", gpu_context.attribute({}, None, 0, GIB)[1])


@unittest.skipIf(torch is None or not torch.cuda.is_available(), "needs a GPU")
class OnGpuTest(unittest.TestCase):
    """With another process holding 2 GiB of the GPU, the context measured
    is what it is with the GPU to itself (within 64 MiB), and says the
    other process's memory was not counted."""

    def measure(self):
        code = textwrap.dedent("""
            import sys
            sys.path.insert(0, %r)
            from gpumem.predict import gpu_context
            before = gpu_context.others()
            import torch
            x = torch.ones(1 << 20, device="cuda")
            print(repr(gpu_context.measure(before)))
        """ % PYTHON_DIR)
        out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, check=True).stdout
        return eval(out.decode().strip().splitlines()[-1])

    def test_other_process_not_counted(self):
        alone, how_alone = self.measure()
        if "NVML" in how_alone:
            self.skipTest("NVML gives no per-process memory here: " + how_alone)
        hog = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import sys, torch
            x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            print("ready", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        try:
            self.assertEqual(hog.stdout.readline().strip(), b"ready")
            shared, how = self.measure()
        finally:
            hog.stdin.close()
            hog.wait()
        self.assertLess(abs(shared - alone), 64 << 20, (alone, shared, how))
        self.assertIn("of other processes on the GPU not counted", how)
        self.assertGreater(alone, 64 << 20)  # a context is hundreds of MiB


if __name__ == "__main__":
    unittest.main()
