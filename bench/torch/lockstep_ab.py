"""Step times of allocators trained in turns, one step at a time, on one GPU.

    python3 bench/torch/lockstep_ab.py WORKLOAD [--steps N] [--warmup W] [--conf C] [--out FILE]
            [--sides SIDE...] [--peak BYTES] [--pairs NUM/DEN...] [--runs R] [--pin]
    python3 bench/torch/lockstep_ab.py --summarize FILE.jsonl...

Starts one process of bench/torch/workloads.py WORKLOAD per side on the same
GPU (by default two: PyTorch's native allocator and gpumem) and lets them
train in turns: step k of each, the order rotating every step (AB, BA, AB,
... for two), each step starting with the GPU idle and the others blocked on
a pipe. All train the same batches (same seeds), so step k has the same
shapes in each.

A side is ALLOCATOR (native, expandable, async, gpumem) or ALLOCATOR@LIMIT:
the process's memory capped at LIMIT bytes (workloads.py --limit: gpumem's
limit: key under gpumem, set_per_process_memory_fraction otherwise); LIMIT
is a byte count or Rx, R times --peak (the job's peak allocated bytes, e.g.
from an unlimited run's native side). --conf (else GPUMEM_CONF from the
environment) applies to every gpumem side; a gpumem side may add its own
configuration after a +, last in the spec (gpumem[@LIMIT]+CONF, e.g.
gpumem+record:/tmp/x-%p.trace.gz): its configuration is that and CONF
joined by a comma (CONF's keys win), so that two gpumem sides can differ by
one setting, in turns on one GPU. A side is labelled by its spec.
A side that runs out of memory stops there; the others go on.

--runs R repeats the whole comparison R times, each time with fresh
processes, and ends with a line of the runs' ratios of medians, their
geometric mean and a 95% interval that resamples runs: the interval to
judge a small difference by, since a process keeps some of its speed for
its whole life (native against native moved 9.5% from run to run on an
H200 host while each run's step-pair interval was 1-2% wide).
--summarize gives the same over the runs it pools.

--pin gives each side cores of its own (the CPUs this process may use, less
the first, which stays with this process, split evenly between the sides):
no side's leftover threads (OpenMP workers spinning after a parallel region,
the CUDA driver's) then share a core with the side whose turn it is. Run r
of --runs hands the sets round by r (side i gets set (i + r) mod sides), so
that over an even number of runs of two sides neither side keeps the faster
cores; each side's line names its CPUs.

--seconds S (with --runs R, at most R runs) starts no run that the longest
run so far says could not end within S seconds of the start: as many fresh
process pairs as a time budget allows, with the summary line over them.

Why: on the GPU machines of 2026-11 the t5 workload leaves the GPU idle most
of each step and its step time follows the host (run medians 152 to 223 ms for
the same program in one call; the garbage collector took under 0.1 ms a
step). Runs one after another, or at the same time on two GPUs, compare
different stretches of the host's speed; in turns, step k of one is paired
with step k of the other a fraction of a second later, and what spread is
left from step to step (sd of the log ratio ~0.15 for t5 on an H200 host)
averages out over some hundreds of step pairs.

Prints one JSON line: per side its per-step times, median, peak reserved and
allocated bytes, whether and where it ran out of memory, and under gpumem
its statistics (device calls, pages mapped and unmapped, synchronizations:
over the whole run and over the timed steps alone); per pair NUM/DEN (side
indices, default every side against side 0) the ratio of the medians and
the geometric mean of the per-step ratios, each with a bootstrap 95%
interval (resampling step pairs). With the default sides the line also
carries the native_* and gpumem_* keys of a plain comparison, which
--summarize pools per workload over earlier runs' lines (from --out).
"""

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ALLOCATORS = ("native", "expandable", "async", "gpumem")


def parse_side(spec, peak):
    """SIDE -> (allocator, limit bytes or None, the side's own GPUMEM_CONF
    or None); a clear error otherwise. CONF comes last, after the first +,
    so that it may hold any character (an @ in a path)."""
    head, plus, conf = spec.partition("+")
    allocator, _, limit = head.partition("@")
    if allocator not in ALLOCATORS:
        raise ValueError("side %r: allocator must be one of %s" % (spec, ", ".join(ALLOCATORS)))
    if plus and allocator != "gpumem":
        raise ValueError("side %r: only a gpumem side takes +CONF (GPUMEM_CONF)" % spec)
    if plus and not conf:
        raise ValueError("side %r: CONF after + is empty (e.g. gpumem+record:/tmp/x-%%p.trace.gz)" % spec)
    conf = conf or None
    if not limit:
        return allocator, None, conf
    relative = limit.endswith("x")
    try:
        value = float(limit[:-1]) if relative else int(limit)
    except ValueError:
        raise ValueError("side %r: LIMIT must be a byte count or a ratio such as 1.02x" % spec) from None
    if relative and not peak:
        raise ValueError("side %r: a limit relative to the peak needs --peak BYTES" % spec)
    nbytes = int(value * peak) if relative else value
    if nbytes <= 0:
        raise ValueError("side %r: the limit must be positive" % spec)
    return allocator, nbytes, conf


def side_conf(common, own):
    """A gpumem side's configuration: the common one, then the side's own,
    joined as one GPUMEM_CONF string (where both set a key, the later one
    wins), or None."""
    return ",".join(x for x in (common, own) if x) or None


def parse_pair(text, count):
    """NUM/DEN -> (num, den), side indices below count."""
    try:
        num, den = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError("pair %r: expected NUM/DEN, two side indices such as 1/0" % text) from None
    if not (0 <= num < count and 0 <= den < count) or num == den:
        raise ValueError("pair %r: indices must be two different sides among 0..%d" % (text, count - 1))
    return num, den


def side_cores(available, count, run_index=0):
    """The CPUs of each of count sides under --pin: the available ones in
    order, the first kept for this process, the rest split evenly (the
    remainder unused), side i taking set (i + run_index) mod count; None
    when there are fewer than one per side."""
    cpus = sorted(available)[1:]
    per = len(cpus) // count if count else 0
    if per == 0:
        return None
    sets = [set(cpus[i * per:(i + 1) * per]) for i in range(count)]
    return [sets[(i + run_index) % count] for i in range(count)]


def start(workload, allocator, limit, conf, args, cores=None):
    cmd = [sys.executable, args.worker, workload, "--allocator", allocator,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--lockstep"]
    if allocator == "gpumem":
        # workloads.py reads GPUMEM_CONF only without --conf: joined here, it
        # stays under a side's own CONF, as under the plain gpumem sides
        common = args.conf if args.conf is not None else os.environ.get("GPUMEM_CONF")
        conf = side_conf(common, conf)
        if conf:
            cmd += ["--conf", conf]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                            preexec_fn=pin)


def take_step(proc):
    """Lets proc run one step: ("ms", its ms), or ("stopped", its JSON
    result) when it stopped before the step (out of memory: the worker
    prints its result and ends), or ("died", exit status) without one."""
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    except BrokenPipeError:
        pass  # it ended already; its output says how
    for line in proc.stdout:
        if line.startswith("LOCKSTEP "):
            return "ms", float(line.split()[2])
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                continue  # not the worker's result: some library's output
            proc.wait()
            return "stopped", result
    return "died", proc.wait()


def final_result(proc):
    """The worker's JSON line, printed after its last step."""
    result = {}
    for line in proc.stdout:
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                pass
    status = proc.wait()
    return result or {"error": "exit %s without a result" % status}


def compare(native, gpumem, seed=0, resamples=4000, names=("native", "gpumem")):
    """Step times of the two (pairs: step k of each) compared: the ratio of
    their medians (gpumem / native) and the geometric mean of the per-step
    ratios, each with a bootstrap 95% interval over the step pairs. names
    label the two in the keys."""
    den, num = names
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
        den + "_median_ms": round(statistics.median(native), 3),
        num + "_median_ms": round(statistics.median(gpumem), 3),
        "ratio_of_medians": round(statistics.median(gpumem) / statistics.median(native), 4),
        "ratio_of_medians_ci95": [round(med_ratio[lo], 4), round(med_ratio[hi], 4)],
        "geo_mean_step_ratio": round(math.exp(statistics.fmean(logs)), 4),
        "step_ratio_ci95": [round(geo[lo], 4), round(geo[hi], 4)],
        "sd_log_step_ratio": round(statistics.stdev(logs), 4),
        num + "_slower_steps": sum(1 for x in logs if x > 0),
    }


def between_runs(ratios, seed=0, resamples=4000):
    """Ratios of medians of several runs, each with fresh processes: their
    geometric mean with a bootstrap 95% interval that resamples runs. What
    stays fixed for a process's life (on the H200 host of 2026-11-27 it
    moved one process's steps by up to 9.5% against another's running the
    same program) is in this interval; a step-pair interval cannot see it."""
    logs = [math.log(r) for r in ratios]
    rnd = random.Random(seed)
    means = sorted(math.exp(statistics.fmean(rnd.choices(logs, k=len(logs)))) for _ in range(resamples))
    lo, hi = int(0.025 * resamples), int(0.975 * resamples) - 1
    return {"runs": len(ratios), "run_ratios": [round(r, 4) for r in ratios],
            "geo_mean_run_ratio": round(math.exp(statistics.fmean(logs)), 4),
            "run_ratio_ci95": [round(means[lo], 4), round(means[hi], 4)]}


def pairs_over_runs(results):
    """Per pair of the runs' JSON lines (the same sides in each): num, den
    and between_runs of the runs whose pair has a ratio ("runs": 0 when
    none has)."""
    out = []
    for k, first in enumerate(results[0]["pairs"]):
        ratios = [r["pairs"][k]["ratio_of_medians"] for r in results if "ratio_of_medians" in r["pairs"][k]]
        pair = {"num": first["num"], "den": first["den"]}
        pair.update(between_runs(ratios) if ratios else {"runs": 0})
        out.append(pair)
    return out


def summarize(paths):
    """Pools the runs of JSON-lines files per (workload, conf, device)."""
    groups = {}
    for path in paths:
        for line in open(path):
            if line.startswith("{"):
                d = json.loads(line)
                if "native_step_ms" not in d:
                    continue  # other sides than native and gpumem, or a side that stopped
                groups.setdefault((d["workload"], d.get("conf"), d.get("device")), []).append(d)
    for (workload, conf, device), runs in groups.items():
        out = {"workload": workload, "conf": conf, "device": device, "runs": len(runs),
               "ratio_of_medians_per_run": [r["ratio_of_medians"] for r in runs]}
        out.update(compare([t for r in runs for t in r["native_step_ms"]],
                           [t for r in runs for t in r["gpumem_step_ms"]]))
        if len(runs) > 1:
            out["between_runs"] = between_runs([r["ratio_of_medians"] for r in runs])
        print(json.dumps(out))


def side_report(label, allocator, limit, times, final, stopped_at, cpus=None):
    """What one side's JSON line says about it (cpus: the set it was pinned to)."""
    out = {
        "label": label,
        "allocator": allocator,
        "limit": limit,
        "cpus": sorted(cpus) if cpus else None,
        "conf": final.get("conf"),
        "steps": len(times),
        "median_ms": round(statistics.median(times), 3) if times else None,
        "step_ms": [round(t, 3) for t in times],
        "peak_reserved": final.get("peak_reserved"),
        "peak_allocated": final.get("peak_allocated"),
        "oom": bool(final.get("oom")),
        "oom_message": final.get("oom_message"),
        "stopped_at": stopped_at,
    }
    if "error" in final:
        out["error"] = final["error"]
    # (gc_ms: per timed step, time in Python's garbage collector: where a
    # step is slow on one side only, whether the collector explains it)
    for key in ("gpumem", "gpumem_timed", "gc_ms"):
        if key in final:
            out[key] = final[key]
    return out


def run(args, parsed, pairs, run_index=0):
    """Trains the sides in turns (parsed: (allocator, limit, conf) per
    side); returns the JSON line's dict with the ratios of pairs. Under
    --pin the CPU sets go round by run_index (see the module's text)."""
    specs = args.sides
    cores = side_cores(os.sched_getaffinity(0), len(specs), run_index) if args.pin else None
    if args.pin and cores is None:
        print("lockstep_ab: --pin: fewer CPUs than sides + 1; not pinned", file=sys.stderr)
    procs = [start(args.workload, alloc, limit, conf, args, cores[i] if cores else None)
             for i, (alloc, limit, conf) in enumerate(parsed)]
    ms = [[] for _ in specs]
    finals = [None] * len(specs)
    stopped_at = [None] * len(specs)
    try:
        for k in range(args.warmup + args.steps):
            running = [i for i in range(len(specs)) if finals[i] is None]
            if not running:
                break
            turn = k % len(running)
            for i in running[turn:] + running[:turn]:
                what, value = take_step(procs[i])
                if what == "ms":
                    if k >= args.warmup:
                        ms[i].append(value)
                    continue
                stopped_at[i] = k
                finals[i] = value if what == "stopped" else {"error": "exit %s before step %d" % (value, k)}
                print("lockstep_ab: %s stopped at step %d: %s" % (
                    specs[i], k, finals[i].get("oom_message") or finals[i].get("error") or "no reason given"),
                      file=sys.stderr)
        for i in range(len(specs)):
            if finals[i] is None:
                finals[i] = final_result(procs[i])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    sides = [side_report(specs[i], parsed[i][0], parsed[i][1], ms[i], finals[i], stopped_at[i],
                         cores[i] if cores else None)
             for i in range(len(specs))]
    result = {"workload": args.workload, "conf": args.conf, "steps": args.steps, "warmup": args.warmup,
              "peak": args.peak, "pin": args.pin, "pinned": cores is not None, "device": next((f.get("device") for f in finals if f.get("device")), None),
              "sides": sides, "pairs": []}
    for num, den in pairs:
        pair = {"num": specs[num], "den": specs[den]}
        gone = [sides[i] for i in (num, den) if sides[i]["stopped_at"] is not None or sides[i]["steps"] == 0]
        if gone:
            pair["skipped"] = "; ".join("%s %s at step %s" % (g["label"], "ran out of memory" if g["oom"] else
                                                               "failed", g["stopped_at"]) for g in gone)
        else:
            pair.update(compare(ms[den], ms[num], names=("den", "num")))
        result["pairs"].append(pair)
    if specs == ["native", "gpumem"] and not result["pairs"][0].get("skipped"):
        # the plain comparison's keys, as --summarize and earlier tools read them
        result.update(compare(ms[0], ms[1]))
        result.update({
            "native_step_ms": sides[0]["step_ms"],
            "gpumem_step_ms": sides[1]["step_ms"],
            "native_peak_reserved": sides[0]["peak_reserved"],
            "gpumem_peak_reserved": sides[1]["peak_reserved"],
            "gpumem_timed": sides[1].get("gpumem_timed"),
        })
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--conf", default=None,
                    help="GPUMEM_CONF of every gpumem side (default: GPUMEM_CONF from the environment)")
    ap.add_argument("--sides", nargs="+", default=["native", "gpumem"], metavar="SIDE",
                    help="ALLOCATOR or ALLOCATOR@LIMIT (bytes, or Rx: R times --peak), a gpumem side with "
                    "+CONF last for its own GPUMEM_CONF (joined after --conf); default: native gpumem")
    ap.add_argument("--peak", type=int, default=None, metavar="BYTES",
                    help="the job's peak allocated bytes, for limits given as Rx")
    ap.add_argument("--pairs", nargs="+", default=None, metavar="NUM/DEN",
                    help="ratios to report, as side indices (default: every side against side 0)")
    # the program each side runs: workloads.py, or a stand-in speaking its
    # protocol (bench/torch/test_harness.py)
    ap.add_argument("--worker", default=os.environ.get("LOCKSTEP_WORKER") or os.path.join(HERE, "workloads.py"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--pin", action="store_true", help="each side on CPUs of its own (see above)")
    ap.add_argument("--runs", type=int, default=1,
                    help="this many runs, each with fresh processes, then a line with the runs' ratios, "
                    "their geometric mean and an interval over runs (see between_runs)")
    ap.add_argument("--seconds", type=float, default=None, metavar="S",
                    help="start no run that could not end within S seconds of the start (judged by the "
                    "longest run so far); --runs is then the most runs")
    ap.add_argument("--out", default=None, help="also append the JSON line to this file")
    ap.add_argument("--summarize", nargs="+", metavar="JSONL",
                    help="train nothing: pool the runs in these files, one line per workload")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if not args.workload:
        ap.error("a workload, or --summarize")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.seconds is not None and args.seconds <= 0:
        ap.error("--seconds must be positive")
    try:
        parsed = [parse_side(spec, args.peak) for spec in args.sides]
        if len(set(args.sides)) != len(args.sides):
            raise ValueError("sides must differ: %s" % " ".join(args.sides))
        pairs = ([parse_pair(p, len(args.sides)) for p in args.pairs] if args.pairs
                 else [(j, 0) for j in range(1, len(args.sides))])
    except ValueError as e:
        ap.error(str(e))
    results = []
    start_time, longest = time.monotonic(), 0.0
    for r in range(args.runs):
        if args.seconds is not None and r > 0 and time.monotonic() - start_time + longest > args.seconds:
            break
        t0 = time.monotonic()
        result = run(args, parsed, pairs, run_index=r)
        longest = max(longest, time.monotonic() - t0)
        results.append(result)
        emit(result, args.out)
    if len(results) > 1:
        emit({"workload": args.workload, "conf": args.conf, "summary_of_runs": len(results),
              "pairs": pairs_over_runs(results)}, args.out)


def emit(result, out):
    line = json.dumps(result)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
