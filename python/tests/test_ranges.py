"""Integers and strings at the boundary to C: ctypes would cut an int of
2**64 or more to 64 bits without a word, and C would end a string at a NUL;
gpumem refuses both, and wrong types, with its own errors."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import gpumem  # noqa: E402
from gpumem import _core  # noqa: E402

MIB = 1 << 20


class RangeTest(unittest.TestCase):
    def setUp(self):
        self.a = gpumem.Allocator("sim", capacity=1 << 34)

    def tearDown(self):
        self.assertEqual(self.a.check(), 0)
        self.a.close()

    def test_sizes_past_64_bits(self):
        with self.assertRaises(gpumem.InvalidArgumentError) as e:
            self.a.malloc(2**64 + 4096)
        self.assertIn("out of range", str(e.exception))
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.set_limit(2**64 + 5)
        self.assertEqual(self.a.get_limit(), 0)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.record_memory_history(2**64)

    def test_pointers_past_64_bits(self):
        q = self.a.malloc(MIB)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.free(q + 2**64)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.free(-q)
        self.assertEqual(self.a.allocation_size(q), MIB)  # still live
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.record_stream(q, 2**64 + 1)
        self.a.free(q)

    def test_wrong_types(self):
        for bad in ("10", 1.5, None, True):
            with self.assertRaises(gpumem.InvalidArgumentError):
                self.a.malloc(bad)
        with self.assertRaises(TypeError):  # also a TypeError, as Python expects
            self.a.malloc("10")
        with self.assertRaises(_core.ArgumentTypeError):
            self.a.free("0x1000")
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.set_limit_fraction(float("nan"))
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.a.set_history_tag(-1)

    def test_nul_in_conf(self):
        with self.assertRaises(gpumem.ConfigError) as e:
            gpumem.Allocator("sim", conf="limit:1G\0,policy:nonsense")
        self.assertIn("NUL", str(e.exception))
        with self.assertRaises(gpumem.ConfigError):
            gpumem.check_conf("policy:default\0")
        with self.assertRaises(gpumem.ConfigError):
            gpumem.check_conf(b"policy:default")


if __name__ == "__main__":
    unittest.main()
