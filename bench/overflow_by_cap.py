"""The overflow tier on the simulated device, trace by trace, under caps
below each trace's peak live bytes: what `gpumem fit --memory CAP` says
the job needs on the host with overflow:host (the most bytes on host pages
at once, requests served on host pages, blocks moved out and back, and
the bytes over the host link as the model counts them: each block crossing
once, kernels' repeated reads not counted).

    python3 bench/overflow_by_cap.py [--gpumem BIN] [--against OTHER_BIN] [--ratios 0.95,0.9,0.8,0.67] TRACE...

With --against, each row sets OTHER_BIN's figures beside BIN's (two builds
of gpumem: before and after a change to the tier), and a summary counts
the rows where each figure fell or rose."""

import argparse
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"with ([0-9.]+) GiB on the host at most: ([0-9,]+) requests on host\s+pages, ([0-9,]+) blocks "
                  r"moved out and ([0-9,]+) back, ([0-9.]+) GiB over the host link")  # fmt: skip
FIELDS = ("host GiB", "requests on host", "moved out", "moved back", "link GiB")


def peak_live(binary, trace):
    out = subprocess.run([binary, "fit", "--memory", "1T", "--json", trace], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, check=True).stdout.decode()  # fmt: skip
    return json.loads(out.splitlines()[0])["peak_live_bytes"]


def tier(binary, trace, cap):
    """The five figures under cap bytes, or None where the tier is not needed
    or the job does not fit even so."""
    done = subprocess.run([binary, "fit", "--memory", "%dB" % cap, trace], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)  # fmt: skip
    m = LINE.search(" ".join(done.stdout.decode().split()))
    if m is None:
        return None
    return tuple(float(g.replace(",", "")) for g in m.groups())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--gpumem", default=os.path.join(REPO, "build", "gpumem"))
    ap.add_argument("--against", help="another gpumem program, its figures set beside")
    ap.add_argument("--ratios", default="0.95,0.9,0.8,0.67", help="caps as shares of each trace's peak live")
    a = ap.parse_args(argv)
    try:
        ratios = [float(r) for r in a.ratios.split(",")]
    except ValueError:
        ap.error("bad --ratios %r (shares of peak live, such as 0.9,0.8)" % a.ratios)
    if not ratios or not all(0 < r < 1 for r in ratios):
        ap.error("--ratios: each share must lie between 0 and 1")
    fell = [0] * len(FIELDS)
    rose = [0] * len(FIELDS)
    rows = 0
    cols = "%-34s %-5s " % ("trace", "cap") + " ".join("%-17s" % f for f in FIELDS)
    print(cols)
    for trace in a.traces:
        live = peak_live(a.gpumem, trace)
        for r in ratios:
            cap = int(live * r)
            new = tier(a.gpumem, trace, cap)
            old = tier(a.against, trace, cap) if a.against else None
            cells = []
            for i in range(len(FIELDS)):
                n = "-" if new is None else "%g" % new[i]
                cells.append("%-17s" % (n if old is None else "%g -> %s" % (old[i], n)))
                if old is not None and new is not None:
                    fell[i] += new[i] < old[i] * 0.999
                    rose[i] += new[i] > old[i] * 1.001
            rows += old is not None and new is not None
            print("%-34s %-5g %s" % (os.path.basename(trace)[:34], r, " ".join(cells)), flush=True)
    if a.against:
        print("\n%d rows with both: " % rows + "; ".join("%s fell on %d, rose on %d" % (f, fell[i], rose[i])
                                                      for i, f in enumerate(FIELDS)))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
