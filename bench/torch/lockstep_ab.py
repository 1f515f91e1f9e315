"""Step time of native PyTorch against gpumem, one step at a time, in turns.

    python3 bench/torch/lockstep_ab.py WORKLOAD [--steps N] [--warmup W] [--conf C] [--out FILE]

Starts two processes of bench/torch/workloads.py WORKLOAD on the same GPU, one
with PyTorch's native allocator and one with gpumem, and lets them train in
turns: step k of one, then step k of the other (the order alternates: AB, BA,
AB, ...), each step starting with the GPU idle and the other process blocked
on a pipe. Both train the same batches (same seeds), so step k has the same
shapes in both.

Why: on the GPU machines of 2026-11 the t5 workload leaves the GPU idle most
of each step and its step time follows the host, whose speed drifts over tens
of seconds (run medians 152 to 223 ms for the same program in one call; the
garbage collector took under 0.1 ms a step). Runs one after another, or at the
same time on two GPUs, compare different stretches of that drift; steps taken
in turns a few hundred milliseconds apart share it.

Prints one JSON line: per-step times of each, the geometric mean of the
per-step ratios gpumem / native over the timed steps with a bootstrap 95%
interval (resampling steps), and the two medians.
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


def take_step(proc, name):
    """Lets proc run one step; returns its ms, or None when it finished
    (its JSON line, out of memory or done, ends the run)."""
    proc.stdin.write("go\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("LOCKSTEP "):
            return float(line.split()[2])
        if line.startswith("{"):
            proc.final = json.loads(line)
            return None
    raise SystemExit(f"lockstep_ab: {name} ended without a result (exit {proc.wait()})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--conf", default=None, help="GPUMEM_CONF of the gpumem process")
    ap.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = ap.parse_args()

    names = ("native", "gpumem")
    procs = {n: start(args.workload, n, args) for n in names}
    for n in names:
        procs[n].final = None
    ms = {n: [] for n in names}
    try:
        for k in range(args.warmup + args.steps):
            order = names if k % 2 == 0 else names[::-1]
            for n in order:
                t = take_step(procs[n], n)
                if t is None:
                    raise SystemExit(f"lockstep_ab: {n} stopped at step {k}: {procs[n].final}")
                if k >= args.warmup:
                    ms[n].append(t)
        for n in names:
            for line in procs[n].stdout:  # the worker's final JSON line
                if line.startswith("{"):
                    procs[n].final = json.loads(line)
            procs[n].wait()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()

    logs = [math.log(g / n) for n, g in zip(ms["native"], ms["gpumem"])]
    rnd = random.Random(0)
    boot = sorted(
        math.exp(statistics.fmean(rnd.choices(logs, k=len(logs)))) for _ in range(5000)
    )
    result = {
        "workload": args.workload,
        "conf": args.conf,
        "steps": args.steps,
        "device": (procs["native"].final or {}).get("device"),
        "native_median_ms": round(statistics.median(ms["native"]), 3),
        "gpumem_median_ms": round(statistics.median(ms["gpumem"]), 3),
        "ratio_of_medians": round(statistics.median(ms["gpumem"]) / statistics.median(ms["native"]), 4),
        "geo_mean_step_ratio": round(math.exp(statistics.fmean(logs)), 4),
        "step_ratio_ci95": [round(boot[125], 4), round(boot[-126], 4)],
        "sd_log_step_ratio": round(statistics.stdev(logs), 4),
        "native_step_ms": [round(t, 3) for t in ms["native"]],
        "gpumem_step_ms": [round(t, 3) for t in ms["gpumem"]],
        "native_peak_reserved": (procs["native"].final or {}).get("peak_reserved"),
        "gpumem_peak_reserved": (procs["gpumem"].final or {}).get("peak_reserved"),
        "gpumem_timed": (procs["gpumem"].final or {}).get("gpumem_timed"),
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
