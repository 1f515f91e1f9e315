"""Out-of-memory errors in the frameworks' own words, without the
frameworks: CuPy's message through a stand-in with CuPy's constructor, and
gpumem.torch.is_oom on the texts PyTorch and gpumem raise."""

import os
import sys
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gpumem.cupy as gcupy  # noqa: E402


class CupyStandInOOM(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError's constructor and message."""

    def __init__(self, size, total, limit=0):
        msg = "Out of memory allocating {:,} bytes (allocated so far: {:,} bytes".format(size, total)
        if limit:
            msg += ", limit set to: {:,} bytes".format(limit)
        super().__init__(msg + ").")


class CupyMessageTest(unittest.TestCase):
    def test_message_opens_as_cupys_then_gpumems_report(self):
        cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=CupyStandInOOM)))
        cls = gcupy._oom_class(cupy)
        e = cls("gpumem: out of memory: tried to allocate 1.00 KiB", 1024, 2048, 4096)
        self.assertIsInstance(e, CupyStandInOOM)
        self.assertEqual(
            str(e),
            "Out of memory allocating 1,024 bytes (allocated so far: 2,048 bytes, limit set to: 4,096 "
            "bytes). gpumem: out of memory: tried to allocate 1.00 KiB",
        )
        self.assertEqual(e.args, (str(e),))
        again = cls(*e.__reduce__()[1])
        self.assertEqual(str(again), str(e))

    def test_without_cupys_class_the_report_alone(self):
        cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(memory=types.SimpleNamespace()))
        e = gcupy._oom_class(cupy)("gpumem: out of memory: x", 10, 0, 0)
        self.assertEqual(str(e), "gpumem: out of memory: x")


if __name__ == "__main__":
    unittest.main()
