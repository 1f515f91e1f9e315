"""A stand-in for bench/torch/workloads.py in the harness tests
(bench/torch/test_harness.py): no torch, no GPU; speaks the same --lockstep
protocol (a line on stdin before each step, 'LOCKSTEP i ms' after it, one
JSON line at the end) with made-up step times.

The job's peak allocated bytes are PEAK. A process capped below
OOM_BELOW x PEAK runs out of memory at step OOM_STEP, gpumem's cap being
FAKE_GPUMEM_FITS x PEAK instead (environment, default 1.0). Step times: 100
ms, x GPUMEM_SLOWDOWN under gpumem, x LIMIT_SLOWDOWN more when capped, plus
a small jitter by step; with a record: key in --conf (gpumem), x
FAKE_RECORD_SLOWDOWN more (default 1.0), and an empty file at its path (%p:
the process id) stands for the recording. FAKE_LOG, when set, gets a line
'ALLOCATOR[@LIMIT] STEP' per step, in the order the steps ran. Peak reserved
is 1.1 x PEAK, or FAKE_RESERVED_<ALLOCATOR> x PEAK where that is set."""

import argparse
import json
import os
import sys

PEAK = 10_000_000_000
OOM_BELOW = 1.015
OOM_STEP = 2
GPUMEM_SLOWDOWN = 1.004
LIMIT_SLOWDOWN = 1.03


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--allocator", default="native")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--conf", default=None)
    ap.add_argument("--lockstep", action="store_true")
    args = ap.parse_args()
    if args.workload == "crash":
        sys.exit(3)
    fits_at = float(os.environ.get("FAKE_GPUMEM_FITS", "1.0")) if args.allocator == "gpumem" else OOM_BELOW
    oom = args.limit is not None and args.limit < fits_at * PEAK
    label = args.allocator + ("@%d" % args.limit if args.limit else "")
    recording = [v for k, _, v in (x.partition(":") for x in (args.conf or "").split(",")) if k == "record"]
    if args.allocator == "gpumem" and recording:
        open(recording[-1].replace("%p", str(os.getpid())), "w").close()
    times = []
    oom_message = None
    for i in range(args.warmup + args.steps):
        if args.lockstep and not sys.stdin.readline():
            sys.exit("fake_workload: the driver went away")
        if oom and i == OOM_STEP:
            oom_message = "CUDA out of memory (fake)"
            break
        ms = 100.0 * (1 + 0.002 * ((i * 7) % 5))
        if args.allocator == "gpumem":
            ms *= GPUMEM_SLOWDOWN * (LIMIT_SLOWDOWN if args.limit else 1.0)
            if recording:
                ms *= float(os.environ.get("FAKE_RECORD_SLOWDOWN", "1.0"))
        if os.environ.get("FAKE_LOG"):
            with open(os.environ["FAKE_LOG"], "a") as f:
                f.write("%s %d\n" % (label, i))
        if args.lockstep:
            print("LOCKSTEP %d %.3f" % (i, ms), flush=True)
        if i >= args.warmup:
            times.append(ms)
    reserved = float(os.environ.get("FAKE_RESERVED_" + args.allocator.upper(), "1.1"))
    result = {"workload": args.workload, "allocator": args.allocator, "conf": args.conf, "limit": args.limit,
              "device": "fake GPU", "steps": len(times), "step_ms": times, "peak_reserved": int(PEAK * reserved),
              "peak_allocated": PEAK, "oom": oom_message is not None, "oom_message": oom_message}
    if args.allocator == "gpumem":
        result["gpumem"] = {"backend_calls.map": 5, "num_syncs": 1}
        result["gpumem_timed"] = {"backend_calls.map": 2} if args.limit else {}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
