"""The table of bench/torch/overflow_caps.sh: one row per cap and way,
step time against the uncapped run, losses against its losses (bit-equal
or the largest difference), what went to host pages, and the best way per
cap (the fastest whose every step finished).

    python bench/torch/overflow_report.py OUT"""

import json
import os
import struct
import sys

DIVS = ("1.10", "1.25", "1.5")
MODES = ("overflow", "microbatch", "fsdp")


def load(out, name):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        return {"error": "no result file"}
    with open(path) as f:
        return json.load(f)


def value(bits):
    return struct.unpack(">f", bytes.fromhex(bits))[0]


def loss_cell(run, ref):
    a, b = run.get("losses") or [], ref.get("losses") or []
    if not a:
        return "-"
    b = b[: len(a)]  # a shorter run (fsdp) against the uncapped run's first steps
    if a == b:
        return "bit-equal"
    diff = max(abs(value(x) - value(y)) for x, y in zip(a, b))
    return "max diff %.3g" % diff


def gib(x):
    return "%.2f" % (x / 2**30) if x else "0"


def main(out):
    ref = load(out, "uncapped")
    lines = []
    if ref.get("error"):
        print("uncapped run failed: %s" % ref["error"])
        return 1
    base = ref["median_step_s"]
    lines.append("device: %s; %d steps of batch %d x %d tokens; uncapped: %.1f ms a step, peak reserved "
                 "%s GiB, peak allocated %s GiB" % (ref.get("device"), ref["steps"], ref["batch"], ref["seq"],
                                                     base * 1e3, gib(ref["peak_reserved"]),
                                                     gib(ref["peak_allocated"])))  # fmt: skip
    lines.append("")
    lines.append("| cap | way | cap GiB | step ms | x uncapped | losses | host GiB peak | moves out/back | note |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    best = {}
    for div in DIVS:
        for mode in MODES:
            r = load(out, "%s_%s" % (mode, div))
            cap = r.get("cap") or 0
            if r.get("error"):
                lines.append("| /%s | %s | %s | - | - | - | - | - | %s |" % (div, mode, gib(cap), r["error"][:120]))
                continue
            t = r["median_step_s"]
            note = ""
            if r.get("microbatches"):
                note = "k = %d at the end" % r["microbatches"][-1]
            if r.get("steps") != ref.get("steps"):
                note = (note + "; " if note else "") + "%d steps" % r["steps"]
            lines.append("| /%s | %s | %s | %.1f | %.2f | %s | %s | %s/%s | %s |" % (
                div, mode, gib(cap), t * 1e3, t / base, loss_cell(r, ref), gib(r.get("host_bytes.all.peak") or 0),
                r.get("num_moves_to_host") or 0, r.get("num_moves_to_device") or 0, note))  # fmt: skip
            if div not in best or t < best[div][1]:
                best[div] = (mode, t)
    lines.append("")
    for div in DIVS:
        if div in best:
            lines.append("best at peak reserved / %s: %s (%.2f x uncapped)" % (div, best[div][0], best[div][1] / base))
        else:
            lines.append("best at peak reserved / %s: none finished" % div)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
