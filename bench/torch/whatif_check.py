"""Compares what bench/torch/whatif_run.py measured on the GPU with what
gpumem replays from the recordings, and prints PASS/FAIL lines:

    python3 bench/torch/whatif_check.py BUILD_DIR OUTDIR WORKLOAD...

1. gpumem-P runs (P = default, pytorch): the recorded trace replayed under
   policy P on the simulated device (capacity = the GPU's memory) against
   the run's peak reserved: exact.
2. native: the run's snapshot pickle replayed under --policy pytorch against
   its peak reserved: within 1%; the same pickle and the gpumem-pytorch
   trace of the same program replayed under the pytorch policy: within 1%.
3. expandable: the expandable run's pickle replayed through the expandable
   segments model against its peak reserved: within 2%.
4. async: the native run's pickle replayed through the cudaMallocAsync
   model against the async run's peak reserved: within 5%.

    python3 bench/torch/whatif_check.py --recording-cost WORKLOAD < LOCKSTEP_LINE

5. what recording costs a step: the JSON line of bench/torch/lockstep_ab.py
   run with the sides gpumem and gpumem+record:PATH, pair 1/0: the ratio of
   the median step times, recording / not, at most 1.01.
"""

import json
import os
import subprocess
import sys

GIB = 1 << 30
RECORDING_COST_MAX = 1.01
failures = 0


def replay(build, path, *args, capacity=None):
    cmd = [os.path.join(build, "gpumem"), "replay", "--json"] + list(args)
    if capacity and "async" not in args and "expandable_segments:True" not in args:
        cmd += ["--capacity", f"{capacity}B"]  # bytes: the command line wants the unit
    if "--policy" in args and "async" not in args and "expandable_segments:True" not in args:
        cmd += ["--passes", "0"]
    cmd.append(path)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def verdict(name, got, want, tolerance):
    global failures
    err = (got - want) / want if want else float("inf")
    ok = abs(err) <= tolerance
    failures += not ok
    tol = "exact" if tolerance == 0 else f"within {tolerance:.0%}"
    print(f"{'PASS' if ok else 'FAIL'} {name}: replayed {got / GIB:.4f} GiB, measured "
          f"{want / GIB:.4f} GiB, error {100 * err:+.3f}% ({tol})", flush=True)


def recording_cost(workload, text, max_ratio=RECORDING_COST_MAX):
    """(ok, line) for lockstep_ab.py's output text (its JSON line last)."""
    name = f"{workload} recording cost (step time with record: / without)"
    lines = [x for x in text.strip().splitlines() if x.startswith("{")]
    if not lines:
        return False, f"FAIL {name}: lockstep_ab.py printed no result"
    pairs = json.loads(lines[-1]).get("pairs") or [{"skipped": "no pair in the result"}]
    pair = pairs[0]
    if "skipped" in pair:
        return False, f"FAIL {name}: {pair['skipped']}"
    ratio = pair["ratio_of_medians"]
    lo, hi = pair["ratio_of_medians_ci95"]
    ok = ratio <= max_ratio
    return ok, (f"{'PASS' if ok else 'FAIL'} {name}: ratio of medians {ratio:.4f} (95% interval "
                f"{lo:.4f} to {hi:.4f}, {pair['step_pairs']} step pairs; at most {max_ratio})")


def load(outdir, workload, mode):
    path = os.path.join(outdir, f"{workload}.{mode}.json")
    if not os.path.exists(path):
        print(f"SKIP {workload} {mode}: no run (see its log)")
        return None
    with open(path) as f:
        return json.load(f)


def main():
    if sys.argv[1] == "--recording-cost":
        ok, line = recording_cost(sys.argv[2], sys.stdin.read())
        print(line, flush=True)
        return 0 if ok else 1
    build, outdir = sys.argv[1], sys.argv[2]
    for w in sys.argv[3:]:
        for policy in ("default", "pytorch"):
            run = load(outdir, w, f"gpumem-{policy}")
            if run:
                trace = os.path.join(outdir, f"{w}.gpumem-{policy}.trace.gz")
                try:
                    r = replay(build, trace, "--policy", policy, capacity=run["device_total"])
                    verdict(f"{w} recorded under gpumem, policy {policy}", r["peak_reserved_bytes"],
                            run["peak_reserved"], 0)
                except RuntimeError as e:
                    print(f"FAIL {w} gpumem-{policy}: {e}")
        native = load(outdir, w, "native")
        pickle = os.path.join(outdir, f"{w}.native.pickle")
        if native and os.path.exists(pickle):
            try:
                r = replay(build, pickle, "--policy", "pytorch", capacity=native["device_total"])
                verdict(f"{w} native snapshot pickle, pytorch policy", r["peak_reserved_bytes"],
                        native["peak_reserved"], 0.01)
                if "recorded_peak_reserved_bytes" in r:
                    print(f"     the pickle's segment events: peak reserved "
                          f"{r['recorded_peak_reserved_bytes'] / GIB:.4f} GiB")
                tr = os.path.join(outdir, f"{w}.gpumem-pytorch.trace.gz")
                if os.path.exists(tr):
                    t = replay(build, tr, "--policy", "pytorch", capacity=native["device_total"])
                    verdict(f"{w} pickle and gpumem trace of one program agree (pytorch policy)",
                            r["peak_reserved_bytes"], t["peak_reserved_bytes"], 0.01)
                a = load(outdir, w, "async")
                if a:
                    m = replay(build, pickle, "--policy", "async")
                    verdict(f"{w} cudaMallocAsync model (native run's pickle)",
                            m["peak_reserved_bytes"], a["peak_reserved"], 0.05)
            except RuntimeError as e:
                print(f"FAIL {w} native: {e}")
        exp = load(outdir, w, "expandable")
        pickle = os.path.join(outdir, f"{w}.expandable.pickle")
        if exp and os.path.exists(pickle):
            try:
                m = replay(build, pickle, "--policy", "pytorch", "--conf", "expandable_segments:True")
                verdict(f"{w} expandable segments model (its own pickle)",
                        m["peak_reserved_bytes"], exp["peak_reserved"], 0.02)
            except RuntimeError as e:
                print(f"FAIL {w} expandable: {e}")
    print(f"whatif: {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
