"""Which of gpumem's settings meet the memory and mapping-work bounds on
which traces, replayed on the simulated device.

    python3 bench/bounds_by_setting.py [--gpumem build/gpumem] [--setting CONF]... TRACE...

The bounds are those bench/memory_vs_peers.py reports against: peak reserved
at most the better of the expandable-segments and cudaMallocAsync models
(the pytorch policy's is above both on every bundled trace), and the first
pass's priced mapping work at most 0.5 us per operation, its second half's
at most 0.05. Each setting (--setting, repeatable; by default the settings
that move memory against mapping work: mapping ahead, the small pool,
lending, the mapping size) is replayed on every trace with no limit; so is
the pytorch policy, whose mapping work is its cudaMalloc calls priced the
same way, to show where native's own growth passes the bounds.

Prints two markdown tables: per setting, on how many traces each bound is
passed and on which all three hold; per trace, the settings under which all
three hold and the lowest peak reserved any of them gave. A trace that no
setting serves within all three says that the bounds conflict there for
every rule tried, not only for the default.
"""

import argparse
import concurrent.futures
import os

from memory_vs_peers import fit_rows, run_json

DEFAULT_SETTINGS = ["", "map_ahead:off", "small_pool:off", "small_pool:off,map_ahead:off", "lend:on",
                    "lend:on,map_ahead:off", "map_max:128M", "map_max:2M"]
FIRST_PASS_US, SECOND_HALF_US = 0.5, 0.05
NATIVE = "pytorch policy"


def better_peer(gpumem, trace):
    rows = fit_rows(gpumem, trace)
    return min(rows["pytorch expandable"]["peak_reserved_bytes"], rows["cudaMallocAsync"]["peak_reserved_bytes"])


def replay(gpumem, trace, setting):
    args = ["--policy", "pytorch"] if setting == NATIVE else (["--conf", setting] if setting else [])
    r = run_json([gpumem, "replay", "--json", "--passes", "0"] + args + [trace])[0]
    return {"name": r["name"], "reserved": r["peak_reserved_bytes"], "live": r["peak_live_bytes"],
            "first": r["est_h100_map_us_per_op_cold"], "second": r["est_h100_map_us_per_op_cold_second_half"]}


def label(setting):
    return setting or "default"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpumem", default=os.path.join("build", "gpumem"))
    ap.add_argument("--setting", action="append", help="a GPUMEM_CONF value to replay under (repeatable)")
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args()
    settings = (args.setting if args.setting else DEFAULT_SETTINGS) + [NATIVE]
    jobs = [(t, s) for t in args.traces for s in settings]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        peers = dict(zip(args.traces, ex.map(lambda t: better_peer(args.gpumem, t), args.traces)))
        results = dict(zip(jobs, ex.map(lambda j: replay(args.gpumem, *j), jobs)))
    names = {t: results[(t, settings[0])]["name"] for t in args.traces}

    def bounds(t, s):
        r = results[(t, s)]
        return r["reserved"] > peers[t], r["first"] > FIRST_PASS_US, r["second"] > SECOND_HALF_US

    print("| setting | above the better peer | first pass over %.1f us/op | second half over %.2f "
          "| all three bounds met |" % (FIRST_PASS_US, SECOND_HALF_US))
    print("|---|---|---|---|---|")
    for s in settings:
        over = [bounds(t, s) for t in args.traces]
        met = [names[t] for t, o in zip(args.traces, over) if not any(o)]
        print("| %s | %d | %d | %d | %d%s |" % (
            label(s), sum(o[0] for o in over), sum(o[1] for o in over), sum(o[2] for o in over),
            len(met), " (%s)" % ", ".join(met) if 0 < len(met) <= 4 else ""))
    print()
    print("| trace | settings meeting all three bounds | lowest peak reserved / peak live, setting "
          "| its first pass, second half (us/op) |")
    print("|---|---|---|---|")
    none = 0
    for t in args.traces:
        met = [label(s) for s in settings if not any(bounds(t, s))]
        none += not met
        low = min(settings, key=lambda s: (results[(t, s)]["reserved"], settings.index(s)))
        r = results[(t, low)]
        print("| %s | %s | %.4f (better peer %.4f), %s | %.3f, %.3f |" % (
            names[t], ", ".join(met) or "**none**", r["reserved"] / r["live"], peers[t] / r["live"], label(low),
            r["first"], r["second"]))
    print("\n%d of %d traces have no setting that meets all three bounds" % (none, len(args.traces)))


if __name__ == "__main__":
    main()
