"""The table of bench/torch/scripts_check.sh: per script and allocator,
the peak reserved `python -m gpumem.predict` gave at the target batch (GPU
recordings, CPU recorder) against the one the script reached there.

    python3 bench/torch/scripts_report.py OUTDIR TARGET SCRIPT...
"""

import json
import os
import re
import sys

ROWS = [("native", "pytorch"), ("expandable", "pytorch expandable"), ("gpumem", "gpumem default")]


def predicted(path):
    """{row name: peak reserved GiB} from the command's table, and its last line."""
    try:
        text = open(path).read()
    except OSError:
        return {}, "missing"
    peaks = {}
    for line in text.splitlines():
        m = re.match(r"(pytorch expandable|pytorch|gpumem default)\s+\S+\s+([\d.]+) GiB", line)
        if m:
            peaks[m.group(1)] = float(m.group(2))
    return peaks, text.strip().splitlines()[-1] if text.strip() else "empty"


def main():
    out, target, scripts = sys.argv[1], sys.argv[2], sys.argv[3:]
    print("| script | route | allocator | predicted at %s | measured | error |" % target)
    print("|---|---|---|---|---|---|")
    for s in scripts:
        n = os.path.splitext(os.path.basename(s))[0]
        for route in ("gpu", "cpu"):
            peaks, last = predicted(os.path.join(out, "%s.%s.txt" % (n, route)))
            for alloc, row in ROWS:
                try:
                    m = json.load(open(os.path.join(out, "%s.%s.json" % (n, alloc))))
                    ran = None if m["oom"] else m["peak_reserved"] / (1 << 30)
                except (OSError, ValueError, KeyError):
                    ran = None
                p = peaks.get(row)
                err = "%+.2f%%" % (100 * (p / ran - 1)) if p and ran else "-"
                print("| %s | %s (%s) | %s | %s | %s | %s |" % (
                    n, route, last, alloc, "%.3f GiB" % p if p else "-", "%.3f GiB" % ran if ran else "-", err))


if __name__ == "__main__":
    main()
