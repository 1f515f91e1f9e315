"""Step time of native PyTorch against gpumem, one step at a time, in turns.

    python3 bench/torch/lockstep_ab.py WORKLOAD [--steps N] [--warmup W] [--conf C] [--out FILE]
    python3 bench/torch/lockstep_ab.py --summarize FILE.jsonl...

Starts two processes of bench/torch/workloads.py WORKLOAD on the same GPU, one
with PyTorch's native allocator and one with gpumem, and lets them train in
turns: step k of one, then step k of the other (the order alternates: AB, BA,
AB, ...), each step starting with the GPU idle and the other process blocked
on a pipe. Both train the same batches (same seeds), so step k has the same
shapes in both.

Why: on the GPU machines of 2026-11 the t5 workload leaves the GPU idle most
of each step and its step time follows the host (run medians 152 to 223 ms for
the same program in one call; the garbage collector took under 0.1 ms a
step). Runs one after another, or at the same time on two GPUs, compare
different stretches of the host's speed; in turns, step k of one is paired
with step k of the other a fraction of a second later, and what spread is
left from step to step (sd of the log ratio ~0.15 for t5 on an H200 host)
averages out over some hundreds of step pairs.

Prints one JSON line: per-step times of each, the two medians and their
ratio, and the geometric mean of the per-step ratios gpumem / native, each
ratio with a bootstrap 95% interval (resampling step pairs). --summarize
pools earlier runs' lines (from --out) per workload the same way.
"""

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def start(workload, allocator, args):
    cmd = [sys.executable, os.path.join(HERE, "workloads.py"), workload, "--allocator", allocator,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--lockstep"]
    if allocator == "gpumem" and args.conf:
        cmd += ["--conf", args.conf]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


def take_step(proc, name, k):
    """Lets proc run step k; returns its ms."""
    proc.stdin.write("go\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("LOCKSTEP "):
            return float(line.split()[2])
        if line.startswith("{"):  # the worker's result before its last step: out of memory
            raise SystemExit(f"lockstep_ab: {name} stopped at step {k}: {line.strip()}")
    raise SystemExit(f"lockstep_ab: {name} ended without a result (exit {proc.wait()})")


def final_result(proc):
    """The worker's JSON line, printed after its last step."""
    result = {}
    for line in proc.stdout:
        if line.startswith("{"):
            result = json.loads(line)
    proc.wait()
    return result


def compare(native, gpumem, seed=0, resamples=4000):
    """Step times of the two (pairs: step k of each) compared: the ratio of
    their medians and the geometric mean of the per-step ratios, each with
    a bootstrap 95% interval over the step pairs."""
    pairs = list(zip(native, gpumem))
    logs = [math.log(g / n) for n, g in pairs]
    rnd = random.Random(seed)
    med_ratio, geo = [], []
    for _ in range(resamples):
        sample = rnd.choices(range(len(pairs)), k=len(pairs))
        med_ratio.append(statistics.median(pairs[i][1] for i in sample) /
                         statistics.median(pairs[i][0] for i in sample))
        geo.append(math.exp(statistics.fmean(logs[i] for i in sample)))
    lo, hi = int(0.025 * resamples), int(0.975 * resamples) - 1
    med_ratio.sort()
    geo.sort()
    return {
        "step_pairs": len(pairs),
        "native_median_ms": round(statistics.median(native), 3),
        "gpumem_median_ms": round(statistics.median(gpumem), 3),
        "ratio_of_medians": round(statistics.median(gpumem) / statistics.median(native), 4),
        "ratio_of_medians_ci95": [round(med_ratio[lo], 4), round(med_ratio[hi], 4)],
        "geo_mean_step_ratio": round(math.exp(statistics.fmean(logs)), 4),
        "step_ratio_ci95": [round(geo[lo], 4), round(geo[hi], 4)],
        "sd_log_step_ratio": round(statistics.stdev(logs), 4),
        "gpumem_slower_steps": sum(1 for x in logs if x > 0),
    }


def summarize(paths):
    """Pools the runs of JSON-lines files per (workload, conf, device)."""
    groups = {}
    for path in paths:
        for line in open(path):
            if line.startswith("{"):
                d = json.loads(line)
                groups.setdefault((d["workload"], d.get("conf"), d.get("device")), []).append(d)
    for (workload, conf, device), runs in groups.items():
        out = {"workload": workload, "conf": conf, "device": device, "runs": len(runs),
               "ratio_of_medians_per_run": [r["ratio_of_medians"] for r in runs]}
        out.update(compare([t for r in runs for t in r["native_step_ms"]],
                           [t for r in runs for t in r["gpumem_step_ms"]]))
        print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--conf", default=None, help="GPUMEM_CONF of the gpumem process")
    ap.add_argument("--out", default=None, help="also append the JSON line to this file")
    ap.add_argument("--summarize", nargs="+", metavar="JSONL",
                    help="train nothing: pool the runs in these files, one line per workload")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if not args.workload:
        ap.error("a workload, or --summarize")

    names = ("native", "gpumem")
    procs = {n: start(args.workload, n, args) for n in names}
    ms = {n: [] for n in names}
    try:
        for k in range(args.warmup + args.steps):
            for n in names if k % 2 == 0 else names[::-1]:
                t = take_step(procs[n], n, k)
                if k >= args.warmup:
                    ms[n].append(t)
        finals = {n: final_result(procs[n]) for n in names}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()

    result = {"workload": args.workload, "conf": args.conf, "steps": args.steps,
              "device": finals["native"].get("device")}
    result.update(compare(ms["native"], ms["gpumem"]))
    result.update({
        "native_step_ms": [round(t, 3) for t in ms["native"]],
        "gpumem_step_ms": [round(t, 3) for t in ms["gpumem"]],
        "native_peak_reserved": finals["native"].get("peak_reserved"),
        "gpumem_peak_reserved": finals["gpumem"].get("peak_reserved"),
        "gpumem_timed": finals["gpumem"].get("gpumem_timed"),
    })
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
