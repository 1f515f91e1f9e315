"""Tests of the step-time harness (lockstep_ab.py, userjobs.py, the
recording-cost verdict of whatif_check.py, the two-GPU driver multigpu.py)
with stand-in workers (fake_workload.py, multigpu.py --launcher fake): no
torch, no GPU.

    python3 -m unittest bench/torch/test_harness.py      (ctest: bench_harness)
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fake_workload  # noqa: E402
import lockstep_ab  # noqa: E402
import whatif_check  # noqa: E402

PEAK = fake_workload.PEAK


def run(script, *args, env=None):
    full = dict(os.environ, LOCKSTEP_WORKER=os.path.join(HERE, "fake_workload.py"), **(env or {}))
    return subprocess.run([sys.executable, os.path.join(HERE, script), *args], capture_output=True, text=True,
                          env=full, timeout=120)


def lockstep(*args, env=None):
    proc = run("lockstep_ab.py", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


class LockstepTest(unittest.TestCase):
    def test_default_sides_keep_the_plain_comparison(self):
        r = lockstep("w", "--steps", "5", "--warmup", "1")
        self.assertEqual([s["label"] for s in r["sides"]], ["native", "gpumem"])
        self.assertEqual(r["step_pairs"], 5)
        self.assertAlmostEqual(r["ratio_of_medians"], fake_workload.GPUMEM_SLOWDOWN, places=3)
        self.assertEqual(len(r["native_step_ms"]), 5)
        self.assertEqual(r["pairs"][0]["num"], "gpumem")
        self.assertEqual(r["sides"][1]["gpumem"]["backend_calls.map"], 5)

    def test_limits_relative_to_the_peak_and_a_side_out_of_memory(self):
        r = lockstep("w", "--steps", "4", "--warmup", "1", "--peak", str(PEAK), "--sides", "expandable@1.01x",
                     "gpumem@1.01x", "gpumem", "--pairs", "1/0", "1/2")
        exp, capped, free = r["sides"]
        self.assertEqual(exp["limit"], int(1.01 * PEAK))
        self.assertTrue(exp["oom"])
        self.assertEqual(exp["stopped_at"], fake_workload.OOM_STEP)
        self.assertIsNone(capped["stopped_at"])
        self.assertEqual(capped["limit"], int(1.01 * PEAK))
        self.assertIsNone(free["limit"])
        self.assertEqual(capped["steps"], 4)
        self.assertIn("ran out of memory at step 2", r["pairs"][0]["skipped"])
        self.assertAlmostEqual(r["pairs"][1]["ratio_of_medians"], fake_workload.LIMIT_SLOWDOWN, places=3)
        self.assertNotIn("native_step_ms", r)  # not the plain comparison

    def test_turns_rotate_and_skip_stopped_sides(self):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "order")
            lockstep("w", "--steps", "4", "--warmup", "1", "--sides", "native", "expandable@1", "gpumem",
                     env={"FAKE_LOG": log})
            order = [line.split() for line in open(log)]
        a, b, c = "native", "expandable@1", "gpumem"
        # step 0: a b c; step 1: b c a; step 2: c a, then b stops (out of
        # memory); the two left rotate by step: step 3 (c a), step 4 (a c)
        self.assertEqual(order, [[a, "0"], [b, "0"], [c, "0"], [b, "1"], [c, "1"], [a, "1"], [c, "2"], [a, "2"],
                                 [c, "3"], [a, "3"], [a, "4"], [c, "4"]])

    def test_a_worker_that_dies_is_reported(self):
        r = lockstep("crash", "--steps", "2", "--warmup", "0")
        self.assertTrue(all("error" in s for s in r["sides"]))
        self.assertIn("failed at step 0", r["pairs"][0]["skipped"])

    def test_a_gpumem_side_of_its_own_conf(self):
        with tempfile.TemporaryDirectory() as d:
            spec = "gpumem+record:" + os.path.join(d, "x-%p.trace.gz")
            r = lockstep("w", "--steps", "4", "--warmup", "1", "--conf", "reclaim:pressure", "--sides", "gpumem",
                         spec, "--pairs", "1/0", env={"FAKE_RECORD_SLOWDOWN": "1.02"})
            recordings = [f for f in os.listdir(d) if f.endswith(".trace.gz")]
        plain, recording = r["sides"]
        self.assertEqual([plain["label"], recording["label"]], ["gpumem", spec])
        self.assertEqual(plain["conf"], "reclaim:pressure")
        self.assertEqual(recording["conf"], "reclaim:pressure," + spec[len("gpumem+"):])
        self.assertEqual(len(recordings), 1)  # only the side that records
        self.assertEqual((r["pairs"][0]["num"], r["pairs"][0]["den"]), (spec, "gpumem"))
        self.assertAlmostEqual(r["pairs"][0]["ratio_of_medians"], 1.02, places=3)

    def test_a_side_conf_joins_gpumem_conf_from_the_environment(self):
        r = lockstep("w", "--steps", "2", "--warmup", "0", "--sides", "native", "gpumem", "gpumem+placement:planned",
                     env={"GPUMEM_CONF": "reclaim:eager"})
        self.assertEqual([s["conf"] for s in r["sides"]],
                         [None, "reclaim:eager", "reclaim:eager,placement:planned"])

    def test_parse_side_takes_conf_last(self):
        # CONF may hold an @ (a path): the limit is read before the +
        self.assertEqual(lockstep_ab.parse_side("gpumem@1.02x+record:/a@b/x.gz", 100),
                         ("gpumem", 102, "record:/a@b/x.gz"))
        self.assertEqual(lockstep_ab.parse_side("native@7", None), ("native", 7, None))
        self.assertEqual(lockstep_ab.side_conf("limit:1G", "record:/x"), "limit:1G,record:/x")
        self.assertEqual(lockstep_ab.side_conf(None, "record:/x"), "record:/x")
        self.assertIsNone(lockstep_ab.side_conf("", None))

    def test_pin_splits_cpus_between_sides(self):
        # the first CPU stays with the harness; the rest go evenly to the sides
        self.assertEqual(lockstep_ab.side_cores({0, 1, 2, 3, 4, 5, 6}, 2), [{1, 2, 3}, {4, 5, 6}])
        self.assertEqual(lockstep_ab.side_cores({8, 3, 5, 9}, 3), [{5}, {8}, {9}])
        self.assertIsNone(lockstep_ab.side_cores({0, 1}, 2))
        # run r hands the sets round by r: over two runs each side has had each set
        self.assertEqual(lockstep_ab.side_cores({0, 1, 2, 3, 4, 5, 6}, 2, 1), [{4, 5, 6}, {1, 2, 3}])
        self.assertEqual(lockstep_ab.side_cores({8, 3, 5, 9}, 3, 4), [{8}, {9}, {5}])
        # and a pinned side runs (one side needs two CPUs: its own and the harness's)
        if len(os.sched_getaffinity(0)) >= 2:
            r = lockstep("w", "--steps", "2", "--warmup", "0", "--sides", "native", "--pin")
            self.assertTrue(r["pinned"])
            self.assertEqual(r["sides"][0]["steps"], 2)

    def test_runs_give_an_interval_over_runs(self):
        proc = run("lockstep_ab.py", "w", "--steps", "3", "--warmup", "0", "--runs", "3")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        lines = [json.loads(x) for x in proc.stdout.strip().splitlines() if x.startswith("{")]
        self.assertEqual(len(lines), 4)  # three runs, then their summary
        pair = lines[-1]["pairs"][0]
        self.assertEqual(pair["runs"], 3)
        self.assertEqual(pair["run_ratios"], [r["ratio_of_medians"] for r in lines[:3]])
        lo, hi = pair["run_ratio_ci95"]
        self.assertTrue(lo <= pair["geo_mean_run_ratio"] <= hi)
        # with one ratio repeated the interval is that ratio
        same = lockstep_ab.between_runs([1.05, 1.05, 1.05])
        self.assertEqual(same["run_ratio_ci95"], [1.05, 1.05])
        self.assertEqual(same["geo_mean_run_ratio"], 1.05)

    def test_seconds_stop_starting_runs(self):
        # the fake's steps take milliseconds: a budget far below one run's
        # length still gives the first run, and no second
        proc = run("lockstep_ab.py", "w", "--steps", "3", "--warmup", "0", "--runs", "5", "--seconds", "0.001")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        lines = [json.loads(x) for x in proc.stdout.strip().splitlines() if x.startswith("{")]
        self.assertEqual(len(lines), 1)
        self.assertEqual(lines[0]["step_pairs"], 3)
        # a generous budget gives every run asked for, and the summary over them
        proc = run("lockstep_ab.py", "w", "--steps", "2", "--warmup", "0", "--runs", "2", "--seconds", "600")
        lines = [json.loads(x) for x in proc.stdout.strip().splitlines() if x.startswith("{")]
        self.assertEqual(lines[-1]["summary_of_runs"], 2)
        self.assertEqual(lines[-1]["pairs"][0]["runs"], 2)
        proc = run("lockstep_ab.py", "w", "--seconds", "0")
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--seconds must be positive", proc.stderr)

    def test_bad_sides_are_named(self):
        for args, why in ((["--sides", "native", "cuda"], "allocator must be one of"),
                          (["--sides", "native", "gpumem@1.1x"], "needs --peak"),
                          (["--sides", "native", "gpumem@lots"], "byte count or a ratio"),
                          (["--sides", "native", "native"], "sides must differ"),
                          (["--sides", "native", "native+record:/x"], "only a gpumem side takes +CONF"),
                          (["--sides", "gpumem", "gpumem+"], "CONF after + is empty"),
                          (["--sides", "gpumem+record:/x", "gpumem+record:/x"], "sides must differ"),
                          (["--pairs", "0/2"], "indices must be two different sides")):
            proc = run("lockstep_ab.py", "w", *args)
            self.assertEqual(proc.returncode, 2, args)
            self.assertIn(why, proc.stderr)

    def test_summarize_pools_only_plain_comparisons(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "runs.jsonl")
            for args in ([], ["--sides", "expandable", "gpumem"]):
                lockstep("w", "--steps", "3", "--warmup", "0", "--out", out, *args)
            proc = run("lockstep_ab.py", "--summarize", out)
            lines = proc.stdout.strip().splitlines()
        self.assertEqual(len(lines), 1)
        self.assertEqual(json.loads(lines[0])["runs"], 1)


class RecordingCostTest(unittest.TestCase):
    def verdict(self, slowdown):
        with tempfile.TemporaryDirectory() as d:
            proc = run("lockstep_ab.py", "w", "--steps", "6", "--warmup", "1", "--sides", "gpumem",
                       "gpumem+record:" + os.path.join(d, "w-%p.trace.gz"), "--pairs", "1/0",
                       env={"FAKE_RECORD_SLOWDOWN": slowdown})
        check = subprocess.run([sys.executable, os.path.join(HERE, "whatif_check.py"), "--recording-cost", "w"],
                               input=proc.stdout, capture_output=True, text=True, timeout=60)
        return check.returncode, check.stdout

    def test_pass_at_most_one_percent(self):
        rc, out = self.verdict("1.01")
        self.assertEqual(rc, 0, out)
        self.assertRegex(out, r"^PASS w recording cost .*: ratio of medians 1\.0100 \(95% interval "
                              r"1\.0\d{3} to 1\.0\d{3}, 6 step pairs; at most 1\.01\)")

    def test_fail_above(self):
        rc, out = self.verdict("1.02")
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL w recording cost", out)
        self.assertIn("ratio of medians 1.0200", out)

    def test_no_result_or_a_side_that_stopped_fails(self):
        self.assertEqual(whatif_check.recording_cost("w", ""),
                         (False, "FAIL w recording cost (step time with record: / without): "
                                 "lockstep_ab.py printed no result"))
        ok, line = whatif_check.recording_cost("w", json.dumps({"pairs": [{"skipped": "x failed at step 0"}]}))
        self.assertFalse(ok)
        self.assertIn("x failed at step 0", line)


class UserJobsTest(unittest.TestCase):
    def drive(self, **env):
        with tempfile.TemporaryDirectory() as d:
            env = dict({"OUT": d, "STEPS": "4", "WARMUP": "1", "WORKLOADS": "a b", "LIMIT_WORKLOADS": "a"}, **env)
            proc = run("userjobs.py", env=env)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            rows = [json.loads(line) for line in open(os.path.join(d, "userjobs.jsonl"))]
            text = open(os.path.join(d, "userjobs.txt")).read()
        return rows, text, proc.stdout

    def test_verdicts(self):
        rows, text, stdout = self.drive()
        verdicts = [(r["workload"], r["phase"], r["verdict"]) for r in rows]
        self.assertEqual(verdicts, [("a", "free", "PASS"), ("a", "limit 1.02x", "FAIL"),
                                    ("a", "limit 1.01x", "PASS"), ("b", "free", "PASS")])
        self.assertIn("gpumem / expandable", rows[1]["why"])  # expandable fits at 1.02 x
        self.assertIn("expandable out of memory", rows[2]["why"])  # not at 1.01 x
        self.assertEqual(rows[1]["limit_bytes"], int(1.02 * PEAK))
        self.assertIn("PASS a free:", stdout)
        self.assertIn("| a | limit 1.01x | expandable@1.01x | 9.41 | 100.4 | 10.24 | 9.31 | out of memory at step 2 |",
                      text)
        self.assertIn("a limit 1.02x gpumem@1.02x: timed steps: map=2", text)

    def test_peers(self):
        rows, text, _ = self.drive(WORKLOADS="a", PHASES="peers", FAKE_RESERVED_NATIVE="1.2",
                                   FAKE_RESERVED_EXPANDABLE="1.05", FAKE_RESERVED_GPUMEM="1.04")
        self.assertEqual([(r["phase"], r["verdict"]) for r in rows], [("peers", "PASS")])
        self.assertIn("peak reserved gpumem 9.69 GiB, at most native's and expandable's", rows[0]["why"])
        self.assertIn("| a | peers | expandable / native |", text)
        rows, _, _ = self.drive(WORKLOADS="a", PHASES="peers", FAKE_RESERVED_GPUMEM="1.15")
        self.assertEqual(rows[0]["verdict"], "FAIL")
        self.assertIn("more than native 10.24 GiB and expandable 10.24 GiB", rows[0]["why"])
        self.assertTrue(rows[0]["why"].startswith("gpumem / native 1.0"), rows[0]["why"])  # the step time too

    def test_gpumem_out_of_memory_under_the_limit_fails(self):
        rows, _, _ = self.drive(WORKLOADS="a", FAKE_GPUMEM_FITS="1.015", LIMITS="1.01")
        self.assertEqual(rows[1]["verdict"], "FAIL")
        self.assertIn("gpumem out of memory at 1.01 x", rows[1]["why"])

    def test_pin_reaches_the_runs(self):
        # (whether the sides were pinned depends on this machine's CPUs; that --pin was asked does not)
        rows, _, _ = self.drive(WORKLOADS="a", LIMITS="1.02", PIN="1")
        self.assertEqual([r["pin"] for r in rows], [True, True])
        rows, _, _ = self.drive(WORKLOADS="a", PHASES="free")
        self.assertEqual([r["pin"] for r in rows], [False])

    def test_runs_judge_over_runs(self):
        rows, _, _ = self.drive(WORKLOADS="a", LIMITS="1.01", RUNS="2")
        free, capped = rows
        self.assertEqual(len(free["over_runs"]), 1)
        self.assertEqual(free["over_runs"][0]["runs"], 2)
        self.assertIn("gpumem / native over 2 runs", free["why"])
        # the verdict takes the ratio over runs, not the last run's
        self.assertIn("%.4f" % free["over_runs"][0]["geo_mean_run_ratio"], free["why"])
        self.assertEqual(capped["verdict"], "PASS")
        self.assertIn("gpumem capped / unlimited over 2 runs", capped["why"])
        # expandable ran out of memory in both runs: no ratio over runs for it
        self.assertEqual(capped["over_runs"][0]["runs"], 0)
        # one run: the run's own interval, as before
        rows, _, _ = self.drive(WORKLOADS="a", PHASES="free")
        self.assertNotIn("over_runs", rows[0])
        self.assertNotIn("over", rows[0]["why"].split("(")[0])

    def test_peak_from_a_native_run_when_the_free_phase_is_off(self):
        rows, _, _ = self.drive(WORKLOADS="a", PHASES="limits", LIMITS="1.02")
        self.assertEqual([r["phase"] for r in rows], ["limit 1.02x"])
        self.assertEqual(rows[0]["peak"], PEAK)

    def test_a_failing_workload_does_not_stop_the_others(self):
        rows, text, _ = self.drive(WORKLOADS="crash b", LIMIT_WORKLOADS="crash")
        self.assertEqual([(r["workload"], r["verdict"]) for r in rows],
                         [("crash", "ERROR"), ("crash", "ERROR"), ("b", "PASS")])
        self.assertIn("ERROR crash limits: no peak allocated", text)

    def test_no_run_starts_past_the_deadline(self):
        rows, _, _ = self.drive(WORKLOADS="a", DEADLINE="30")
        self.assertTrue(all(r["verdict"] == "ERROR" and "DEADLINE" in r["why"] for r in rows[:1]))


class MultiGpuTest(unittest.TestCase):
    """multigpu.py's driver with its fake launcher: the same FIFO turns,
    rotation, result and checks as under torchrun, with sleeping ranks."""

    def drive(self, *extra, env=None):
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run(
                [sys.executable, os.path.join(HERE, "multigpu.py"), "run", "--strategy", "fsdp2", "--launcher",
                 "fake", "--steps", "4", "--warmup", "1", "--deterministic", "--timeout", "60", "--out", out,
                 *extra], capture_output=True, text=True, env=dict(os.environ, **(env or {})), timeout=120)
            with open(os.path.join(out, "result.json")) as f:
                return proc, json.load(f)

    def test_every_side_takes_its_turns_in_rotation(self):
        proc, r = self.drive()
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(r["order"][:3], [["native", "expandable", "gpumem"], ["expandable", "gpumem", "native"],
                                          ["gpumem", "native", "expandable"]])
        self.assertEqual({k: v["status"] for k, v in r["sides"].items()},
                         {"native": "ok", "expandable": "ok", "gpumem": "ok"})
        verdicts = {c["check"]: c["verdict"] for c in r["checks"]}
        self.assertEqual(verdicts["losses gpumem = native"], "PASS")
        self.assertEqual(verdicts["allocator gpumem"], "PASS")

    def test_a_side_out_of_memory_stops_alone(self):
        proc, r = self.drive(env={"MULTIGPU_FAKE_EVENTS": "gpumem:oom:2:1"})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual((r["sides"]["gpumem"]["status"], r["sides"]["gpumem"]["stopped_at"]), ("oom", 2))
        self.assertEqual(r["sides"]["native"]["status"], "ok")
        self.assertEqual(r["sides"]["expandable"]["status"], "ok")


if __name__ == "__main__":
    unittest.main()
