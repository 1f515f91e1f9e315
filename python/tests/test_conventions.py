"""The package follows torch.cuda's conventions where it mirrors them
(memory_summary's abbreviated table, memory_stats' keys and numbers, the
pool rows adding up to the total, the device and size forms), runs the
command line as `python -m gpumem`, and refuses at the boundary to C what C
would silently change: strings holding a NUL, integers out of their C
type's range, wrong types."""

import gzip
import importlib.util
import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
ROOT = os.path.dirname(PYTHON_DIR)
sys.path.insert(0, PYTHON_DIR)

import gpumem  # noqa: E402
from gpumem import _cli, errors  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
TRACE = os.path.join(ROOT, "traces", "gpt2_train.trace.gz")
POOL_ROWS = ("from large pool", "from small pool")
# torch.cuda.memory_stats()'s keys (PyTorch 2.x), every one of them: the
# arrays and counters test_sim checks, and the oversize ones.
sys.path.insert(0, HERE)
from test_sim import TORCH_ARRAYS as ARRAYS, TORCH_COUNTERS  # noqa: E402

METRICS = ("current", "peak", "allocated", "freed")
TORCH_KEYS = (
    ["%s.%s.%s" % (a, p, m) for a in ARRAYS for p in ("all", "large_pool", "small_pool") for m in METRICS]
    + ["oversize_allocations.%s" % m for m in METRICS]
    + ["oversize_segments.%s" % m for m in METRICS]
    + TORCH_COUNTERS
    + ["max_split_size"]
)


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = PYTHON_DIR + os.pathsep + e.get("PYTHONPATH", "")
    return e


def table(text):
    """A summary's lines, less the count of mem_info calls (each summary
    asks the device for its free memory once, and counts it)."""
    return [line for line in text.splitlines() if "Backend calls: mem_info" not in line]


def busy(a):
    """Large and small blocks, some freed: every pool row has figures."""
    keep = [a.malloc(s) for s in (3 * MIB, 100, 40 * MIB, 5000)]
    for s in (7 * MIB, 600):
        a.free(a.malloc(s))
    return keep


class SummaryTest(unittest.TestCase):
    def setUp(self):
        self.a = gpumem.Allocator("sim", capacity=GIB)
        gpumem.set_allocator(0, self.a)
        self.ptrs = busy(self.a)

    def tearDown(self):
        for p in self.ptrs:
            self.a.free(p)
        gpumem.set_allocator(0, None)
        self.a.close()

    def assert_abbreviated_of(self, full, short):
        self.assertIn(POOL_ROWS[0], full)
        self.assertIn(POOL_ROWS[1], full)
        for row in POOL_ROWS:
            self.assertNotIn(row, short)
        # the same table otherwise: the total rows and everything after them
        kept = [line for line in table(full) if not any(r in line for r in POOL_ROWS)]
        self.assertEqual(table(short), kept)

    def test_module_function(self):
        full = gpumem.memory_summary(0)
        self.assertEqual(table(full), table(gpumem.memory_summary(0, abbreviated=False)))
        self.assert_abbreviated_of(full, gpumem.memory_summary(0, abbreviated=True))
        self.assert_abbreviated_of(full, gpumem.memory_summary(abbreviated=True, device="cuda:0"))

    def test_allocator_method(self):
        self.assert_abbreviated_of(self.a.memory_summary(), self.a.memory_summary(abbreviated=True))

    def test_device_nothing_used(self):
        # no allocator on device 7: the table of zeros, abbreviated too
        self.assert_abbreviated_of(gpumem.memory_summary(7), gpumem.memory_summary(7, True))

    @unittest.skipIf(importlib.util.find_spec("torch") is None, "needs torch (any build)")
    def test_torch_memory_summary_passes_abbreviated(self):
        # torch.cuda.memory_summary as gpumem.torch patches it, on a device
        # served by a simulated allocator: no GPU needed.
        code = (
            "import sys, torch, gpumem, gpumem.torch as gt\n"
            "a = gpumem.Allocator('sim', capacity=1 << 30)\n"
            "gpumem.set_allocator(0, a)\n"
            "p = a.malloc(3 << 20); q = a.malloc(100)\n"
            "gt._install_patches(torch, {}, graphs=True)\n"
            "sys.stdout.write(torch.cuda.memory_summary(0, abbreviated=True))\n"
            "sys.stdout.write('@@@')\n"
            "sys.stdout.write(torch.cuda.memory_summary(0))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            timeout=120,
        )
        self.assertEqual(out.returncode, 0, out.stderr.decode())
        short, full = out.stdout.decode().split("@@@")
        self.assertIn("gpumem memory summary", short)
        self.assert_abbreviated_of(full, short)


class StatsTest(unittest.TestCase):
    def test_torch_keys_all_numbers(self):
        with gpumem.Allocator("sim", capacity=GIB, conf="policy:pytorch,max_split_size_mb:64") as a:
            ptrs = busy(a)
            stats = a.memory_stats()
            for key in TORCH_KEYS:
                self.assertIn(key, stats)
            for key, value in stats.items():
                self.assertIsInstance(value, (int, float), key)
                self.assertNotIsInstance(value, bool, key)
            self.assertEqual(stats["max_split_size"], 64 * MIB)
            self.assertEqual(stats["oversize_segments.peak"], 0)
            self.assertEqual(a.policy, "pytorch")
            for p in ptrs:
                a.free(p)
        with gpumem.Allocator("sim", capacity=GIB) as a:
            self.assertEqual(a.memory_stats()["max_split_size"], -1)  # torch's "unset"
            self.assertEqual(a.policy, "default")
        # a device nothing has used: the same keys, all zero but max_split_size
        stats = gpumem.memory_stats(9)
        for key in TORCH_KEYS:
            self.assertEqual(stats[key], -1 if key == "max_split_size" else 0, key)
        self.assertNotIn("policy", stats)

    def check_pools_add_up(self, stats, where):
        for name in ARRAYS:
            row = lambda pool, m: stats["%s.%s.%s" % (name, pool, m)]  # noqa: E731
            for m in ("current", "allocated", "freed"):
                self.assertEqual(
                    row("large_pool", m) + row("small_pool", m),
                    row("all", m),
                    "%s: %s.%s: large + small != all" % (where, name, m),
                )
                self.assertEqual(
                    row("all", "allocated") - row("all", "freed"), row("all", "current"), name
                )
            # peaks are reached at different times: bounded, not a sum
            self.assertLessEqual(max(row("large_pool", "peak"), row("small_pool", "peak")), row("all", "peak"))
            self.assertLessEqual(row("all", "peak"), row("large_pool", "peak") + row("small_pool", "peak"))

    def test_pool_rows_add_up_replaying_gpt2(self):
        # The bundled trace moves reserved pages between the pools (a page
        # made live in a small segment): the totals must count the move too.
        for conf in (None, "policy:pytorch"):
            with gpumem.Allocator("sim", conf=conf) as a:
                live = {}
                with gzip.open(TRACE, "rt") as f:
                    for line in f:
                        parts = line.split()
                        if not parts or parts[0] == "#":
                            continue
                        if parts[0] == "a":
                            live[parts[1]] = a.malloc(int(parts[2]), int(parts[3]))
                        elif parts[0] == "f":
                            a.free(live.pop(parts[1]))
                stats = a.memory_stats()
                self.check_pools_add_up(stats, conf or "default policy")
                self.assertEqual(a.check(), 0)
                table = a.memory_summary()
                for p in live.values():
                    a.free(p)
                a.empty_cache()
                self.check_pools_add_up(a.memory_stats(), "%s, emptied" % (conf or "default policy"))
            self.assertIn("GPU reserved memory", table)


class DeviceAndSizeFormsTest(unittest.TestCase):
    def test_allocator_takes_the_module_functions_device_forms(self):
        # No GPU here: every form must reach the CUDA backend (which then
        # fails for want of a driver or a device), not be refused as a type.
        for device in (0, "cuda", "cuda:0", "0"):
            try:
                gpumem.Allocator(device).close()
            except TypeError as e:
                self.fail("Allocator(%r): %s" % (device, e))
            except gpumem.GpumemError as e:
                self.assertNotIsInstance(e, gpumem.InvalidArgumentError, "Allocator(%r)" % (device,))
        for device in ("cuda:x", "cpu", "cuda:-1", -1, 2**31):
            with self.assertRaises(gpumem.InvalidArgumentError) as cm:
                gpumem.Allocator(device)
            self.assertIn("device", str(cm.exception))
        with self.assertRaises(gpumem.ArgumentTypeError):
            gpumem.Allocator(1.5)

    @unittest.skipIf(importlib.util.find_spec("torch") is None, "needs torch (any build)")
    def test_torch_device(self):
        import torch

        self.assertEqual(gpumem.device_index(torch.device("cuda:3")), 3)
        with self.assertRaises(gpumem.InvalidArgumentError):
            gpumem.device_index(torch.device("cpu"))

    def test_sizes_in_every_form(self):
        with gpumem.Allocator("sim", capacity="8G", page_size="2M") as a:
            self.assertEqual(a.memory_stats()["device_total"], 8 * GIB)
            a.set_limit("4G")
            self.assertEqual(a.get_limit(), 4 * GIB)
            a.set_limit(3 * GIB)
            self.assertEqual(a.get_limit(), 3 * GIB)
        for bad in ("8 furlongs", "-1G", ""):
            with self.assertRaises(gpumem.InvalidArgumentError) as cm:
                gpumem.Allocator("sim", capacity=bad)
            self.assertIn("capacity", str(cm.exception))
        self.assertEqual(gpumem.parse_size(4096), 4096)

    def test_one_simulated_device_default(self):
        with gpumem.Allocator("sim") as a:
            total = a.memory_stats()["device_total"]
        self.assertEqual(total, gpumem.SIM_CAPACITY)
        cli = _cli.find()
        if cli is None:
            self.skipTest("no gpumem command line program built")
        help_text = subprocess.run([cli, "replay", "--help"], stdout=subprocess.PIPE).stdout.decode()
        m = re.search(r"--capacity SIZE\s+simulated device memory \(default (\S+)\)", help_text)
        self.assertIsNotNone(m, help_text)
        self.assertEqual(gpumem.parse_size(m.group(1)), total)


class MainTest(unittest.TestCase):
    def run_main(self, *args):
        return subprocess.run(
            [sys.executable, "-m", "gpumem"] + list(args), env=env(), cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
        )

    def test_version(self):
        out = self.run_main("--version")
        self.assertEqual(out.returncode, 0, out.stderr.decode())
        self.assertIn(gpumem.__version__, out.stdout.decode())

    def test_runs_the_command_line(self):
        cli = _cli.find()
        if cli is None:
            self.skipTest("no gpumem command line program built")
        out = self.run_main("summary", TRACE)
        self.assertEqual(out.returncode, 0, out.stderr.decode())
        direct = subprocess.run([cli, "summary", TRACE], stdout=subprocess.PIPE, cwd=ROOT)
        measured = lambda text: [ln for ln in text.splitlines() if b"measured" not in ln]  # noqa: E731
        self.assertEqual(measured(out.stdout), measured(direct.stdout))  # but the timings
        self.assertIn(b"gpumem memory summary", out.stdout)
        bad = self.run_main("no-such-command")
        self.assertEqual(bad.returncode, subprocess.run([cli, "no-such-command"], stderr=subprocess.PIPE).returncode)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn(b"no-such-command", bad.stderr)


class BoundaryTest(unittest.TestCase):
    def setUp(self):
        self.a = gpumem.Allocator("sim", capacity=GIB)

    def tearDown(self):
        self.a.close()

    def assert_refused(self, fn, name, cls=None):
        cls = cls or gpumem.InvalidArgumentError
        with self.assertRaises(cls) as cm:
            fn()
        self.assertIsInstance(cm.exception, gpumem.GpumemError)
        self.assertIn(name, str(cm.exception))
        return cm.exception

    def test_nul_in_strings(self):
        e = self.assert_refused(lambda: self.a.record_trace("x\0y"), "path")
        self.assertIsInstance(e, ValueError)
        self.assertIn("NUL", str(e))
        self.assert_refused(lambda: gpumem.parse_size("1G\0junk"), "size")
        self.assert_refused(lambda: self.a.memory_snapshot(tag_file="a\0b"), "tag_file")
        self.assert_refused(lambda: self.a.set_limit("1G\0"), "limit")
        self.assert_refused(lambda: gpumem.Allocator("sim", capacity="1G\0x"), "capacity")
        self.assert_refused(lambda: self.a.record_trace(b"x\0y"), "path")
        self.assertEqual(self.a.get_limit(), 0)

    def test_integers_out_of_range(self):
        self.assert_refused(lambda: gpumem.Allocator(device=4294967295), "device")
        self.assert_refused(lambda: gpumem.Allocator(device=-4294967291), "device")
        self.assert_refused(lambda: gpumem.memory_stats(device=4294967295), "device")
        self.assert_refused(lambda: gpumem.memory_summary(device=-1), "device")
        self.assert_refused(lambda: gpumem.memory_snapshot(device=2**32), "device")
        self.assert_refused(lambda: gpumem.empty_cache(device=2**32), "device")
        self.assert_refused(lambda: self.a.memory_snapshot(device=2**32), "device")
        self.assert_refused(lambda: self.a.sim_fail(kind=2**64), "kind")
        self.assert_refused(lambda: self.a.sim_fail(kind=99), "kind")  # no such call
        self.assert_refused(lambda: self.a.sim_fail(skip=2**63), "skip")
        self.assert_refused(lambda: self.a.sim_fail(skip=-1), "skip")
        self.assert_refused(lambda: self.a.sim_fail(count=2**63), "count")
        self.assert_refused(lambda: self.a.sim_fail(status=2**32 + 3), "status")
        self.assert_refused(lambda: self.a.sim_fail(status=0), "status")
        self.assert_refused(lambda: gpumem.Allocator("sim", capacity=2**64), "capacity")
        self.assert_refused(lambda: gpumem.Allocator("sim", page_size=-2), "page_size")
        self.assert_refused(lambda: self.a.host_view(0, 2**64), "size")
        self.assert_refused(lambda: gpumem.StepLeakWatcher(self.a, patience=2**40), "patience")

    def test_sim_fail_still_works(self):
        self.a.sim_fail(kind="map", skip=0, count=1)
        self.a.sim_fail(kind=-1, count=-1, status=errors.ERR_BACKEND)
        with self.assertRaises(gpumem.GpumemError):
            self.a.malloc(64 * MIB)
        self.a.sim_fail_clear()
        self.a.free(self.a.malloc(64 * MIB))

    def test_wrong_types(self):
        t = gpumem.ArgumentTypeError
        for fn, name in [
            (lambda: self.a.record_trace(5), "path"),
            (lambda: self.a.memory_snapshot(tag_file=1), "tag_file"),
            (lambda: gpumem.parse_size(None), "size"),
            (lambda: gpumem.parse_size(b"1G"), "size"),
            (lambda: self.a.sim_fail(kind=1.0), "kind"),
            (lambda: self.a.sim_fail(count="1"), "count"),
            (lambda: gpumem.memory_stats(device=1.0), "device"),
            (lambda: gpumem.set_allocator(0, "not an allocator"), "alloc"),
            (lambda: gpumem.set_per_process_memory_fraction("0.5"), "fraction"),
            (lambda: self.a.set_limit(None), "limit"),
        ]:
            e = self.assert_refused(fn, name, t)
            self.assertIsInstance(e, TypeError)
        self.assert_refused(lambda: gpumem.LeakCheck(self.a, action="shout"), "action")
        self.assert_refused(lambda: gpumem.set_per_process_memory_fraction(1.5), "fraction")


if __name__ == "__main__":
    unittest.main()
