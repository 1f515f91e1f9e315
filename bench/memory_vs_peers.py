"""Peak reserved memory of gpumem's default beside PyTorch's allocators, on
traces replayed on the simulated device: the pytorch policy (PyTorch's
caching allocator rule for rule), the models of expandable segments and
cudaMallocAsync (docs/whatif.md), and the default's priced mapping work.

    python3 bench/memory_vs_peers.py [--gpumem build/gpumem] [--conf CONF] TRACE...

One row per trace (a markdown table, as BENCHMARKS.md quotes it): peak
reserved / peak live under each, the default's distance to the better peer
model (negative: below it), the smallest limit the default replays under,
and the first pass's priced mapping work per operation and that of its
second half (a long job's steady state), then the first pass's growth of
the pytorch policy (its cudaMalloc calls) and of the expandable-segments
model (a physical allocation per page), priced the same way; the
cudaMallocAsync model's growth is the driver's and is not priced. The
last line counts the traces
where the default reserves more than the pytorch policy or a peer model,
and the synchronizations the replays made. --conf replays gpumem with
settings over its defaults (the min limit column stays the defaults').
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys


def run_json(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit("%s: %s" % (" ".join(cmd), done.stderr.strip()))
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def fit_rows(gpumem, trace):
    """gpumem fit's line per allocator (pytorch, its models, gpumem's), by name, no limit."""
    return {r["allocator"]: r for r in run_json([gpumem, "fit", "--memory", "1000G", "--json", trace])}


def one(gpumem, trace, conf):
    rows = fit_rows(gpumem, trace)
    replay = run_json([gpumem, "replay", "--json", "--passes", "0"] + (["--conf", conf] if conf else []) + [trace])[0]
    native = run_json([gpumem, "replay", "--json", "--passes", "0", "--policy", "pytorch", trace])[0]
    expandable = run_json([gpumem, "replay", "--json", "--policy", "pytorch",
                           "--conf", "expandable_segments:True", trace])[0]
    return trace, rows, replay, native, expandable


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpumem", default=os.path.join("build", "gpumem"))
    ap.add_argument("--conf", default="", help="gpumem settings for the replay, e.g. lend:ordered")
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args()
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        results = list(ex.map(lambda t: one(args.gpumem, t, args.conf), args.traces))
    print("| trace | pytorch | expandable | cudaMallocAsync | default | vs better peer | min limit "
          "| us/op 1st pass | 2nd half | pytorch us/op | expandable us/op |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    more = syncs = 0
    for trace, rows, rep, native, expandable in results:
        live = rep["peak_live_bytes"]
        ratio = {k: rows[k]["peak_reserved_bytes"] / live for k in rows}
        p, e, a = ratio["pytorch"], ratio["pytorch expandable"], ratio["cudaMallocAsync"]
        d = rep["peak_reserved_bytes"] / live
        more += d > p or d > min(e, a)
        syncs += rep["num_syncs"]
        print("| %s | %.4f | %.4f | %.4f | %.4f | %+.4f | %.4f | %.3f | %.3f | %.3f | %.3f |" % (
            rep["name"], p, e, a, d, d - min(e, a), rows["gpumem default"]["needed_bytes"] / live,
            rep["est_h100_map_us_per_op_cold"], rep["est_h100_map_us_per_op_cold_second_half"],
            native["est_h100_map_us_per_op_cold"], expandable["est_h100_map_us_per_op_cold"]))
    print("\nthe default reserves more than the pytorch policy or a peer model on %d of %d traces; "
          "the replays synchronized streams %d times" % (more, len(results), syncs))


if __name__ == "__main__":
    main()
