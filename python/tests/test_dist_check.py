"""bench/torch/dist_check.py's bookkeeping, with a stand-in for torchrun: the
walk to the largest batch under a cap (up while runs fit, down while they
run out of memory, stopped by any other failure), the rows it reads from
`python -m gpumem.predict --gpus` tables, and the comparison of each rank's
measured peak with both predictions. Needs nothing but Python."""

import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "torch")
sys.path.insert(0, BENCH)

import dist_check  # noqa: E402

GIB = 2**30
TABLE = """2 GPUs: rank 0; rank 1
  allocator            largest batch/GPU  peak reserved at batch 32   with context+NCCL
  -------------------------------------------------------------------------------------
  pytorch              112 (rank 0)       8.543 GiB                   9.679 GiB
  pytorch expandable   114+ (rank 0)      8.141 GiB                   9.276 GiB
  gpumem default       108-111            -                           -
"""


class StandIn:
    """torchrun as dist_check calls it: a batch fits up to each allocator's
    limit; past `fail_past` the run fails otherwise; reports each rank."""

    def __init__(self, limits, fail_past=None):
        self.limits, self.fail_past, self.calls = limits, fail_past, []

    def __call__(self, nproc, allocator, args, log, timeout, conf=None):
        b = int(args[args.index("--batch-size") + 1])
        self.calls.append((allocator, b, "--memory-fraction" in args))
        if self.fail_past is not None and b > self.fail_past:
            return 1
        report = args[args.index("--report") + 1]
        for r in range(nproc):
            with open(report if r == 0 else "%s.rank%d.json" % (report, r), "w") as f:
                json.dump({"peak_reserved": (8.5 + 0.25 * r) * GIB, "pid": 100 + r}, f)
        return 0 if b <= self.limits[allocator] else "oom"


class DistCheckTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.out = self.dir.name
        os.makedirs(os.path.join(self.out, "predicted"))
        for tag in ("ddp_bert_base_cap", "ddp_bert_base_b32"):
            with open(os.path.join(self.out, "predicted", tag + ".txt"), "w") as f:
                f.write(TABLE)
        self.real = dist_check.torchrun

    def tearDown(self):
        dist_check.torchrun = self.real
        self.dir.cleanup()

    def walk(self, limits, fail_past=None):
        dist_check.torchrun = StandIn(limits, fail_past)
        dist_check.cap(self.out, ["ddp_bert_base"], list(dist_check.ALLOCATORS), 2, 0.3, 10)
        got = {}
        for al in dist_check.ALLOCATORS:
            with open(os.path.join(self.out, "cap", "ddp_bert_base_%s.json" % al)) as f:
                got[al] = json.load(f)
        return got, dist_check.torchrun.calls

    def test_rows_of_a_gpus_table(self):
        self.assertEqual(dist_check.predicted_row(TABLE, "pytorch"), (112, 8.543 * GIB))
        self.assertEqual(dist_check.predicted_row(TABLE, "pytorch expandable"), (114, 8.141 * GIB))
        self.assertEqual(dist_check.predicted_row(TABLE, "gpumem default"), (108, None))
        self.assertIsNone(dist_check.predicted_row(TABLE, "cudaMallocAsync"))

    def test_the_walk_finds_the_grid_point_below_the_first_out_of_memory(self):
        grid = dist_check.GRID
        got, calls = self.walk({"native": 100, "expandable": 140, "gpumem": 105})
        # native: from the grid point at or below its 112, which runs out, down to one that fits
        self.assertEqual(got["native"]["largest"], max(g for g in grid if g <= 100))
        # expandable: up from 114's grid point while runs fit
        self.assertEqual(got["expandable"]["largest"], max(g for g in grid if g <= 140))
        self.assertEqual(got["gpumem"]["largest"], max(g for g in grid if g <= 105))
        self.assertTrue(all(capped for _, _, capped in calls))
        for al, r in got.items():
            above = min(g for g in grid if g > r["largest"])
            self.assertEqual(r["runs"][str(above)], "oom", al)
            self.assertEqual(r["runs"][str(r["largest"])], "fits", al)

    def test_a_failure_that_is_not_out_of_memory_stops_the_walk(self):
        got, _ = self.walk({"native": 1000, "expandable": 1000, "gpumem": 1000}, fail_past=115)
        self.assertIsNone(got["expandable"]["largest"])
        self.assertIn("error 1", got["expandable"]["runs"].values())

    def test_compare_sets_each_rank_beside_both_predictions(self):
        dist_check.torchrun = StandIn({"native": 100, "expandable": 140, "gpumem": 105})
        dist_check.measure(self.out, ["ddp_bert_base"], ["native"], 2, 10)
        os.makedirs(os.path.join(self.out, "recorded"))
        for r, peak in ((0, 8.6), (1, 8.8)):
            with open(os.path.join(self.out, "recorded", "ddp_bert_base_b32.rank%d.json" % r), "w") as f:
                json.dump({"allocators": [{"allocator": "pytorch", "peak_reserved_bytes": peak * GIB}]}, f)
        dist_check.compare(self.out, 2)
        with open(os.path.join(self.out, "compare.txt")) as f:
            rows = [line.split() for line in f if line.startswith("ddp_bert_base ")]
        b32 = [r for r in rows if r[1] == "32"][0]
        # each rank measured; both predictions against the rank that reserved most (8.75 GiB)
        self.assertEqual(b32[2:6], ["native", "8.500", "/", "8.750"])
        self.assertEqual(b32[6:], ["8.543", "%+.2f%%" % (100 * (8.543 / 8.75 - 1)), "8.800",
                                   "%+.2f%%" % (100 * (8.8 / 8.75 - 1))])  # fmt: skip


if __name__ == "__main__":
    unittest.main()
