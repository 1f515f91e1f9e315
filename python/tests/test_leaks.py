"""Leak detection from Python on the simulated device: marks, the report as
a dict and as text, and leak_check()'s three actions; the out-of-memory
post-mortem (option oom_snapshot) read back as a snapshot.

Run from the repository root:
    GPUMEM_LIBRARY=build/libgpumem.so python3 -m unittest discover -s python/tests -v
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/, where the package lives

import gpumem  # noqa: E402

MIB = 1 << 20


class LeakTest(unittest.TestCase):
    def setUp(self):
        self.a = gpumem.Allocator("sim", capacity=1 << 34)

    def tearDown(self):
        self.assertEqual(self.a.check(), 0, gpumem.last_error())
        self.a.close()

    def step(self, keep, tag):
        """A step: temporaries freed, one 3 MiB tensor kept in keep."""
        self.a.set_history_tag(tag)
        tmp = [self.a.malloc(n * MIB) for n in (8, 16)]
        keep.append(self.a.malloc(3 * MIB))
        for p in tmp:
            self.a.free(p)

    def test_marks_and_report(self):
        weights = self.a.malloc(32 * MIB)
        mark = self.a.leak_mark()
        self.assertEqual(mark, 1)
        kept = []
        for tag in range(1, 4):
            self.step(kept, tag)
        got = self.a.leaks(mark)
        self.assertEqual((got["count"], got["made"], got["since"]), (3, 10, 1))
        self.assertEqual(len(got["groups"]), 1)
        g = got["groups"][0]
        self.assertEqual((g["requested"], g["count"], g["first_tag"], g["last_tag"]), (3 * MIB, 3, 1, 3))
        self.assertEqual(g["addresses"], kept)
        self.assertEqual((g["first"], g["last"]), (4, 10))
        # since 0: the weights too, the larger group first
        every = self.a.leaks()
        self.assertEqual([x["requested"] for x in every["groups"]], [32 * MIB, 3 * MIB])
        text = self.a.leak_report(mark)
        self.assertIn("3 allocations made after #1 still live", text)
        self.assertIn("tags 1..3", text)
        for p in kept + [weights]:
            self.a.free(p)
        self.assertEqual(self.a.leaks()["count"], 0)
        self.assertIn("no allocation made after #0 is live", self.a.leak_report())

    def test_leak_check_actions(self):
        kept = []
        with self.a.leak_check(action=None) as clean:
            self.step([], 1)  # what it keeps is dropped below
        # step([]) kept its tensor in a list nobody holds: the pointer is
        # still allocated (the allocator cannot know), so it is reported
        self.assertEqual(clean.leaks["count"], 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with self.a.leak_check() as check:
                self.step(kept, 2)
                self.step(kept, 3)
        self.assertEqual(check.leaks["count"], 2)
        self.assertEqual(len(caught), 1)
        self.assertTrue(issubclass(caught[0].category, gpumem.LeakWarning))
        self.assertIn("2 allocations made after", str(caught[0].message))
        with self.assertRaises(gpumem.LeakError) as raised:
            with self.a.leak_check(action="raise"):
                self.step(kept, 4)
        self.assertEqual(raised.exception.leaks["count"], 1)
        # a block that frees what it takes: nothing said
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with self.a.leak_check(action="raise") as quiet:
                p = self.a.malloc(MIB)
                self.a.free(p)
        self.assertEqual((quiet.leaks["count"], len(caught)), (0, 0))
        # the block's own exception wins over the report
        with self.assertRaises(KeyError):
            with self.a.leak_check(action="raise"):
                kept.append(self.a.malloc(MIB))
                raise KeyError("inside")
        with self.assertRaises(ValueError):
            self.a.leak_check(action="shout")

    def test_step_watcher(self):
        # weights, then optimizer state made in the first step and kept:
        # never reported
        self.a.malloc(32 * MIB)
        w = gpumem.StepLeakWatcher(self.a, patience=3, action=None)
        grads = []
        state = []

        def train_step(leak):
            for g in grads:  # zero_grad(set_to_none=True) of the step before
                self.a.free(g)
            grads.clear()
            tmp = self.a.malloc(64 * MIB)
            grads.append(self.a.malloc(4 * MIB))  # lives until the next step
            if not state:
                state.append(self.a.malloc(8 * MIB))
            if leak:
                kept.append(self.a.malloc(2 * MIB))
            self.a.free(tmp)
            return w.step()

        kept = []
        for _ in range(8):
            self.assertIsNone(train_step(False))
        self.assertEqual(w.reports, [])
        # a leak from step 9 on: reported once three completed steps kept
        # something (at the end of step 12), then after three more
        got = [train_step(True) for _ in range(8)]
        self.assertEqual([i for i, r in enumerate(got) if r], [3, 7])
        first = w.reports[0]
        self.assertEqual(first["steps"], 12)
        # the kept tensors (three steps before and this one), then this
        # step's gradients
        self.assertEqual([g["requested"] for g in first["groups"]], [2 * MIB, 4 * MIB])
        self.assertEqual(first["groups"][0]["count"], 4)
        # once it stops leaking, nothing more
        self.assertTrue(all(train_step(False) is None for _ in range(6)))
        self.assertEqual(len(w.reports), 2)
        with self.assertRaises(gpumem.LeakError):
            r = gpumem.StepLeakWatcher(self.a, patience=1, action="raise")
            kept.append(self.a.malloc(MIB))
            r.step()
            kept.append(self.a.malloc(MIB))
            r.step()
        with self.assertRaises(ValueError):
            gpumem.StepLeakWatcher(self.a, patience=0)

    def test_leak_check_at_exit(self):
        # a per-device allocator (here a simulated one serving device 0)
        # reports at exit while module globals still hold their memory,
        # once: not again when finalization destroys it
        code = (
            "import gpumem\n"
            "a = gpumem.Allocator('sim', capacity=1 << 30, conf='leak_check:on')\n"
            "gpumem.set_allocator(0, a)\n"
            "a.set_history_tag(9)\n"
            "KEPT = a.malloc(3 << 20)\n"
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("gpumem leak check (at exit): 1 allocation made after #0 still live", proc.stderr)
        self.assertIn("tag 9", proc.stderr)
        self.assertEqual(proc.stderr.count("gpumem leak check"), 1, proc.stderr)

    def test_shared_budget(self):
        with tempfile.TemporaryDirectory() as d:
            os.environ["GPUMEM_PUBLISH_DIR"] = d
            try:
                conf = "shared_limit:1G,shared_name:py%d" % os.getpid()
                with gpumem.Allocator("sim", capacity=1 << 34, conf=conf) as a, gpumem.Allocator(
                    "sim", capacity=1 << 34, conf=conf
                ) as b:
                    p = a.malloc(700 * MIB)
                    with self.assertRaises(gpumem.OutOfMemoryError) as oom:
                        b.malloc(400 * MIB)
                    self.assertIn("the shared limit of 1.00 GiB", str(oom.exception))
                    info = b.shared_budget()
                    self.assertEqual((info["limit"], info["allocators"]), (1 << 30, 2))
                    self.assertEqual(info["total"], a.memory_stats()["reserved_bytes.all.current"] + info["mine"])
                    a.free(p)
                    a.empty_cache()
                    b.free(b.malloc(400 * MIB))
                with self.assertRaises(gpumem.UnsupportedError):
                    self.a.shared_budget()
            finally:
                del os.environ["GPUMEM_PUBLISH_DIR"]

    def test_oom_snapshot(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "oom-%p.json")
            with gpumem.Allocator("sim", capacity=1 << 34, conf="limit:64M,oom_snapshot:" + path) as a:
                a.set_history_tag(7)
                p = a.malloc(40 * MIB)
                with self.assertRaises(gpumem.OutOfMemoryError) as oom:
                    a.malloc(40 * MIB)
                written = path.replace("%p", str(os.getpid()))
                self.assertIn("Post-mortem: snapshot written to " + written, str(oom.exception))
                self.assertIn("Live: 1 allocation in 1 group of one size and stream; the largest: 1 x 40.00 MiB (#1, tag 7).", str(oom.exception))
                with open(written) as f:
                    snap = json.load(f)
                blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
                self.assertEqual([b["address"] for b in blocks], [p])
                self.assertEqual(blocks[0]["frames"][0]["line"], 7)
                self.assertEqual(a.check(), 0)
                a.free(p)


if __name__ == "__main__":
    unittest.main()
