"""Jobs as users run them, gpumem against PyTorch's allocators, trained in
turns on one GPU (bench/torch/lockstep_ab.py), with and without limits.

    python3 bench/torch/userjobs.py          (bash bench/torch/userjobs.sh BUILD sets the environment)

Per workload (WORKLOADS):
  free     native and gpumem, no limit: gpumem's step time against native's
           (PASS: ratio of medians <= 1.01 and the upper end of its 95%
           interval <= 1.02). Native's peak allocated bytes are the job's
           peak for the limits below.
  peers    native, gpumem and expandable segments, no limit, in turns
           (PASS: gpumem / native as in free, and gpumem's peak reserved
           at most native's and expandable segments').
  limits   for each R in LIMITS, three sides capped or not: expandable
           segments at R x peak, gpumem at R x peak, gpumem unlimited.
           Where expandable segments runs, gpumem capped must be within 1%
           of it (PASS: ratio <= 1.01); where it runs out of memory, gpumem
           capped must be within 10% of gpumem unlimited (PASS: <= 1.10).
           Workloads in LIMIT_WORKLOADS only.

Each result is one JSON line in OUT/userjobs.jsonl (lockstep_ab.py's, plus
"phase", "ratio" and "verdict"); OUT/userjobs.txt gets the table printed at
the end. A run that fails or times out is reported and the others go on;
no run starts that could not end before DEADLINE seconds from the start.

Environment (all optional):
  WORKLOADS        "llama_finetune_varlen llama_generate_serve" (any of
                   bench/torch/workloads.py's: the bundled four too)
  LIMIT_WORKLOADS  the workloads of WORKLOADS but llama_generate_serve
  LIMITS           "1.02 1.01" (ratios of the job's peak allocated bytes)
  PHASES           "free limits" (and/or peers)
  STEPS, WARMUP    timed and warm-up steps per run (default per workload,
                   DEFAULT_STEPS and DEFAULT_WARMUP: 40 and 4 unless listed)
  CONF             GPUMEM_CONF of the gpumem sides (default: none, the
                   library's default policy)
  PIN=1            each side on CPUs of its own (lockstep_ab.py --pin)
  RUNS=1           runs of fresh processes per comparison (lockstep_ab.py
                   --runs, as many as fit in RUN_TIMEOUT each); with more
                   than one, each verdict takes the geometric mean of the
                   runs' ratios of medians and its interval over runs (a
                   process keeps part of its speed for its life, so one
                   run's interval cannot judge 1%); the table shows the
                   last run's sides
  RUN_TIMEOUT=300  seconds per run;  DEADLINE=540 seconds in all
  OUT              directory for the results (default: BUILD/userjobs)
"""

import json
import os
import signal
import subprocess
import sys
import time

import lockstep_ab  # (beside this file: run as a script, its folder is on the path)

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30
# (a generate() of 256 tokens on GPT-2 large takes seconds: fewer steps)
DEFAULT_STEPS = {"llama_finetune_varlen": 30, "gpt2_generate": 6, "gpt2_beam_serve": 12, "lora_peft_ckpt": 20}
DEFAULT_WARMUP = {"gpt2_generate": 1}
MIN_RUN_S = 60  # a run needs at least this long (process start, model build, steps)

FREE_RATIO_MAX, FREE_CI_HIGH_MAX = 1.01, 1.02
VS_EXPANDABLE_MAX = 1.01
VS_UNLIMITED_MAX = 1.10


def env_list(name, default):
    value = os.environ.get(name)
    return value.split() if value is not None else list(default)


def settings(environ=os.environ):
    workloads = env_list("WORKLOADS", ["llama_finetune_varlen", "llama_generate_serve"])
    return {
        "workloads": workloads,
        "limit_workloads": env_list("LIMIT_WORKLOADS", [w for w in workloads if w != "llama_generate_serve"]),
        "limits": [float(x) for x in env_list("LIMITS", ["1.02", "1.01"])],
        "phases": env_list("PHASES", ["free", "limits"]),
        "steps": int(environ["STEPS"]) if environ.get("STEPS") else None,
        "warmup": int(environ["WARMUP"]) if environ.get("WARMUP") else None,
        "conf": environ.get("CONF") or None,
        "pin": environ.get("PIN") == "1",
        "runs": max(1, int(environ.get("RUNS") or 1)),
        "run_timeout": int(environ.get("RUN_TIMEOUT") or 300),
        "deadline": int(environ.get("DEADLINE") or 540),
    }


def warmup_of(workload, cfg):
    return cfg["warmup"] if cfg["warmup"] is not None else DEFAULT_WARMUP.get(workload, 4)


class Clock:
    def __init__(self, deadline_s):
        self.start = time.monotonic()
        self.deadline_s = deadline_s

    def left(self):
        return self.deadline_s - (time.monotonic() - self.start)


def run_command(cmd, timeout):
    """Runs cmd in its own process group (its workers too); returns (exit
    status or "timeout", stdout, stderr tail). A timeout kills the group."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = "timeout"
    sys.stderr.write(err)
    return status, out, err.strip().splitlines()[-3:]


def json_lines(text):
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def last_json(text):
    lines = json_lines(text)
    return lines[-1] if lines else None


def lockstep(workload, sides, pairs, cfg, clock, peak=None):
    """One lockstep_ab.py comparison: its (last) run's JSON line, with the
    pairs over runs as "over_runs" where it made several; or a line saying
    why none."""
    steps = cfg["steps"] or DEFAULT_STEPS.get(workload, 40)
    runs = cfg["runs"]
    timeout = min(cfg["run_timeout"] * runs, clock.left())
    if timeout < MIN_RUN_S:
        return {"workload": workload, "error": "skipped: %.0f s left before DEADLINE" % clock.left()}
    cmd = [sys.executable, os.path.join(HERE, "lockstep_ab.py"), workload, "--steps", str(steps),
           "--warmup", str(warmup_of(workload, cfg)), "--sides"] + sides + ["--pairs"] + pairs
    if peak:
        cmd += ["--peak", str(peak)]
    if cfg["conf"]:
        cmd += ["--conf", cfg["conf"]]
    if cfg["pin"]:
        cmd.append("--pin")
    if runs > 1:
        # (the budget leaves the last run time to end before the timeout)
        cmd += ["--runs", str(runs), "--seconds", str(max(1, int(timeout - 10)))]
    t0 = time.monotonic()
    status, out, tail = run_command(cmd, timeout)
    # (from the runs' own lines: a timeout may cut the summary line off)
    run_lines = [d for d in json_lines(out) if "sides" in d]
    if run_lines:
        result = run_lines[-1]
        if len(run_lines) > 1:
            result["over_runs"] = lockstep_ab.pairs_over_runs(run_lines)
    else:
        why = "timed out after %.0f s" % timeout if status == "timeout" else "exit %s" % status
        result = {"workload": workload, "error": "%s: %s" % (why, " | ".join(tail)[-400:])}
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def pair_of(result, num, den):
    for p in result.get("pairs", []):
        if p["num"] == num and p["den"] == den:
            return p
    return None


def side_of(result, label):
    for s in result.get("sides", []):
        if s["label"] == label:
            return s
    return None


def judged(result, pair):
    """The ratio a verdict takes for pair (num over den): over runs where
    the comparison made two or more that gave it, else the run's ratio of
    medians; (ratio, (low, high), words saying which)."""
    for p in result.get("over_runs") or []:
        if p["num"] == pair["num"] and p["den"] == pair["den"] and p.get("runs", 0) >= 2:
            return p["geo_mean_run_ratio"], p["run_ratio_ci95"], " over %d runs" % p["runs"]
    return pair["ratio_of_medians"], pair["ratio_of_medians_ci95"], ""


def judge_free(result):
    """PASS / FAIL / ERROR of an unlimited gpumem-against-native run."""
    pair = pair_of(result, "gpumem", "native")
    if pair is None or "skipped" in pair:
        return "ERROR", (pair or {}).get("skipped") or result.get("error", "no result")
    ratio, (lo, hi), over = judged(result, pair)
    ok = ratio <= FREE_RATIO_MAX and hi <= FREE_CI_HIGH_MAX
    return ("PASS" if ok else "FAIL"), "gpumem / native%s %.4f [%.4f, %.4f] (need <= %.2f, upper <= %.2f)" % (
        over, ratio, lo, hi, FREE_RATIO_MAX, FREE_CI_HIGH_MAX)


def judge_peers(result):
    """PASS / FAIL / ERROR of an unlimited run of native, gpumem and
    expandable segments: the step time as judge_free has it, and gpumem's
    peak reserved at most each peer's."""
    verdict, why = judge_free(result)
    if verdict == "ERROR":
        return verdict, why
    gm = side_of(result, "gpumem")
    over = []
    for peer in ("native", "expandable"):
        s = side_of(result, peer)
        if s is None or s["stopped_at"] is not None:
            return "ERROR", "%s did not run to the end" % peer
        if gm["peak_reserved"] > s["peak_reserved"]:
            over.append("%s %s GiB" % (peer, gib(s["peak_reserved"])))
    if over:
        verdict = "FAIL"
    return verdict, "%s; peak reserved gpumem %s GiB%s" % (
        why, gib(gm["peak_reserved"]), ", more than " + " and ".join(over) if over else ", at most native's and "
        "expandable's")


def judge_limit(result, r):
    """PASS / FAIL / ERROR at limit r: against expandable segments where it
    ran, else against gpumem unlimited."""
    exp, gm = "expandable@%gx" % r, "gpumem@%gx" % r
    if "error" in result:
        return "ERROR", result["error"]
    capped = side_of(result, gm)
    if capped is None or capped["stopped_at"] is not None:
        why = "out of memory" if capped and capped["oom"] else "failed"
        return "FAIL", "gpumem %s at %g x peak allocated" % (why, r)
    vs_exp = pair_of(result, gm, exp)
    if vs_exp is not None and "skipped" not in vs_exp:
        ratio, ci, over = judged(result, vs_exp)
        return ("PASS" if ratio <= VS_EXPANDABLE_MAX else "FAIL"), (
            "expandable runs; gpumem / expandable%s %.4f [%.4f, %.4f] (need <= %.2f)" % (
                over, ratio, *ci, VS_EXPANDABLE_MAX))
    vs_free = pair_of(result, gm, "gpumem")
    if vs_free is None or "skipped" in vs_free:
        return "ERROR", "no unlimited gpumem to compare with: %s" % ((vs_free or {}).get("skipped"),)
    ratio, ci, over = judged(result, vs_free)
    return ("PASS" if ratio <= VS_UNLIMITED_MAX else "FAIL"), (
        "expandable out of memory; gpumem capped / unlimited%s %.4f [%.4f, %.4f] (need <= %.2f)" % (
            over, ratio, *ci, VS_UNLIMITED_MAX))


def native_peak(workload, cfg, clock):
    """The job's peak allocated bytes from a native run alone (the same
    steps), when the unlimited comparison did not give it."""
    steps = cfg["steps"] or DEFAULT_STEPS.get(workload, 40)
    timeout = min(cfg["run_timeout"], clock.left())
    if timeout < MIN_RUN_S:
        return None
    worker = os.environ.get("LOCKSTEP_WORKER") or os.path.join(HERE, "workloads.py")
    status, out, tail = run_command([sys.executable, worker, workload, "--allocator",
                                     "native", "--steps", str(steps), "--warmup", str(warmup_of(workload, cfg))], timeout)
    result = last_json(out)
    if not result or result.get("oom"):
        print("userjobs: %s: no native peak (%s)" % (workload, status), file=sys.stderr)
        return None
    return result.get("peak_allocated")


def gib(n):
    return "%.2f" % (n / GIB) if isinstance(n, (int, float)) else "-"


def gpumem_counts(side):
    """gpumem's device work in a side's timed steps and in its whole run."""
    if side.get("allocator") != "gpumem":
        return ""
    keys = (("backend_calls.map", "map"), ("backend_calls.unmap", "unmap"), ("backend_calls.create_page", "create"),
            ("backend_calls.release_page", "release"), ("num_syncs", "syncs"),
            ("num_sync_all_streams", "sync_all"), ("num_pages_mapped", "pages_mapped"),
            ("num_pages_unmapped", "pages_unmapped"), ("num_alloc_retries", "retries"),
            ("mapping_time_ns", "mapping_ns"))
    timed, whole = side.get("gpumem_timed") or {}, side.get("gpumem") or {}
    return "timed steps: %s; whole run: %s" % (
        " ".join("%s=%s" % (short, timed.get(k, 0)) for k, short in keys),
        " ".join("%s=%s" % (short, whole.get(k, 0)) for k, short in keys))


def table(results):
    """The human-readable report of all results."""
    lines = []
    dev = next((r.get("device") for r in results if r.get("device")), "unknown GPU")
    lines.append("Jobs as users run them, in turns on one GPU (%s)" % dev)
    lines.append("")
    lines.append("| workload | phase | side | cap GiB | median ms | peak reserved GiB | peak allocated GiB "
                 "| stopped |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in results:
        if not r.get("sides"):
            lines.append("| %s | %s | error: %s | | | | | |" % (r["workload"], r.get("phase"), r.get("error")))
            continue
        for s in r["sides"]:
            stopped = "no"
            if s["stopped_at"] is not None:
                stopped = "%s at step %s" % ("out of memory" if s["oom"] else "failed", s["stopped_at"])
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
                r["workload"], r.get("phase"), s["label"], gib(s["limit"]),
                "-" if s["median_ms"] is None else s["median_ms"], gib(s["peak_reserved"]),
                gib(s["peak_allocated"]), stopped))
    lines.append("")
    lines.append("| workload | phase | ratio | median ratio [95%] | geo-mean step ratio [95%] | step pairs |")
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        for p in r.get("pairs", []):
            name = "%s / %s" % (p["num"], p["den"])
            if "skipped" in p:
                lines.append("| %s | %s | %s | skipped: %s | | |" % (r["workload"], r.get("phase"), name, p["skipped"]))
                continue
            lines.append("| %s | %s | %s | %.4f [%.4f, %.4f] | %.4f [%.4f, %.4f] | %d |" % (
                r["workload"], r.get("phase"), name, p["ratio_of_medians"], *p["ratio_of_medians_ci95"],
                p["geo_mean_step_ratio"], *p["step_ratio_ci95"], p["step_pairs"]))
    lines.append("")
    lines.append("gpumem's device work (backend calls and synchronizations):")
    for r in results:
        for s in r.get("sides", []):
            if s.get("allocator") == "gpumem":
                lines.append("  %s %s %s: %s" % (r["workload"], r.get("phase"), s["label"], gpumem_counts(s)))
    lines.append("")
    for r in results:
        lines.append("%s %s %s: %s" % (r.get("verdict", "ERROR"), r["workload"], r.get("phase"), r.get("why", "")))
    return "\n".join(lines) + "\n"


def main():
    cfg = settings()
    build = os.environ.get("BUILD_DIR") or os.path.join(os.path.dirname(os.path.dirname(HERE)), "build")
    out_dir = os.environ.get("OUT") or os.path.join(build, "userjobs")
    os.makedirs(out_dir, exist_ok=True)
    jsonl = os.path.join(out_dir, "userjobs.jsonl")
    open(jsonl, "w").close()
    clock = Clock(cfg["deadline"])
    results = []

    def record(result, phase, verdict, why):
        result.update({"phase": phase, "verdict": verdict, "why": why})
        results.append(result)
        with open(jsonl, "a") as f:
            f.write(json.dumps(result) + "\n")
        print("%s %s %s: %s (%.0f s, %.0f s left)" % (verdict, result["workload"], phase, why,
                                                    result.get("wall_s", 0), clock.left()), flush=True)

    for w in cfg["workloads"]:
        peak = None
        if "free" in cfg["phases"]:
            r = lockstep(w, ["native", "gpumem"], ["1/0"], cfg, clock)
            record(r, "free", *judge_free(r))
            native = side_of(r, "native")
            if native and native["stopped_at"] is None:
                peak = native["peak_allocated"]
        if "peers" in cfg["phases"]:
            r = lockstep(w, ["native", "gpumem", "expandable"], ["1/0", "2/0"], cfg, clock)
            record(r, "peers", *judge_peers(r))
        if "limits" not in cfg["phases"] or w not in cfg["limit_workloads"]:
            continue
        if peak is None:
            peak = native_peak(w, cfg, clock)
        if not peak:
            record({"workload": w, "error": "no peak allocated from a native run"}, "limits", "ERROR",
                   "no peak allocated from a native run")
            continue
        for r_ in cfg["limits"]:
            sides = ["expandable@%gx" % r_, "gpumem@%gx" % r_, "gpumem"]
            r = lockstep(w, sides, ["1/0", "1/2"], cfg, clock, peak=peak)
            r["ratio"] = r_
            r["limit_bytes"] = int(r_ * peak)
            record(r, "limit %gx" % r_, *judge_limit(r, r_))

    text = table(results)
    with open(os.path.join(out_dir, "userjobs.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    print("userjobs: results in %s (userjobs.jsonl, userjobs.txt), %.0f s in all" % (
        out_dir, time.monotonic() - clock.start))


if __name__ == "__main__":
    main()
