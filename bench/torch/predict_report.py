"""The tables of bench/torch/predict_accuracy.py's results.json, as markdown.

    python3 bench/torch/predict_report.py OUTDIR/results.json

Errors are predicted / measured - 1. A largest batch is compared on the grid
of ~10% steps (predict_accuracy.GRID): 0 steps off is exact.
"""

import json
import sys

GIB = 1 << 30
ROW = {"native": "pytorch", "expandable": "pytorch expandable", "gpumem": "gpumem default"}


def batch_grid(limit=1 << 16):
    """Batch sizes in steps of about 10%: 1, 2, ..., 16, 18, 20, 22, ..."""
    out = [1]
    while out[-1] < limit:
        out.append(max(out[-1] + 1, round(out[-1] * 1.1)))
    return out


GRID = batch_grid()


def grid_floor(b):
    """The largest grid point at or below b (None for no batch)."""
    return None if not isinstance(b, int) or b < 1 else max(g for g in GRID if g <= b)


def err(pred, meas):
    if not pred or not meas:
        return None
    return pred / meas - 1


def pct(e):
    return "-" if e is None else "%+.1f%%" % (100 * e)


def gib(n):
    return "-" if not n else "%.2f" % (n / GIB)


def measured_peak(r):
    """(peak reserved bytes, None) of a measuring run, or (None, why not)."""
    if not r:
        return None, "not run"
    if "skipped" in r:
        return None, r["skipped"]
    if r.get("oom"):
        return None, "out of memory"
    return r["peak_reserved"], None


def peak_rows(results):
    """One row per (job, target): measured and predicted per allocator."""
    rows = []
    for job, jr in results["jobs"].items():
        for t in map(str, results["targets"]):
            row = {"job": job, "batch": int(t)}
            for a in ("native", "expandable", "gpumem"):
                m, why = measured_peak(jr.get("measured", {}).get(t, {}).get(a))
                row[a] = m
                row[a + "_why"] = why
                for src in ("gpu", "cpu"):
                    p = jr.get("predicted_" + src, {})
                    row["%s_%s" % (a, src)] = p.get("targets", {}).get(t, {}).get(ROW[a])
                    if p.get("error"):
                        row["%s_%s_why" % (a, src)] = p["error"]
            rows.append(row)
    return rows


DIRECT_TITLES = {
    "predicted_direct": "The CPU recorder at the batch itself (what `python -m gpumem.predict` checks on fake "
                        "tensors)",
    "predicted_probe": "Fake tensors at the batch itself with the convolutions run on the GPU (what `python -m "
                       "gpumem.predict` checks on a GPU machine)",
}


def direct_report(results, key="predicted_direct"):
    """The recorder at the batch itself (the direct or probe phase):
    peaks and the largest batch under the cap, for every allocator."""
    out = ["### %s\n" % DIRECT_TITLES[key],
           "| job | batch | native | error | expandable | error | gpumem | error |", "|---|---|---|---|---|---|---|---|"]
    errs = []
    for job, jr in results["jobs"].items():
        d = jr.get(key, {})
        for t in map(str, results["targets"]):
            cells = [job, t]
            for a in ("native", "expandable", "gpumem"):
                m, why = measured_peak(jr.get("measured", {}).get(t, {}).get(a))
                e = err(d.get("targets", {}).get(t, {}).get(ROW[a]), m)
                if m is not None:
                    errs.append((job, int(t), a, e))
                cells += [gib(m) if m is not None else (why or "-"), pct(e)]
            out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for lim in (0.02, 0.05, 0.10):
        ok = [x for x in errs if x[3] is not None and abs(x[3]) <= lim]
        nat = [x for x in errs if x[2] == "native"]
        nat_ok = [x for x in ok if x[2] == "native"]
        out.append("Within %d%%: %d of %d (native: %d of %d)." % (100 * lim, len(ok), len(errs), len(nat_ok),
                                                                  len(nat)))
    for job, b, a, e in errs:
        if e is None or abs(e) > 0.02:
            out.append("- over 2%%: %s batch %d %s: %s" % (job, b, a, pct(e) if e is not None else "no figure"))
    out.append("")
    out.append("| job | allocator | measured largest | at the batches | steps off | recordings |")
    out.append("|---|---|---|---|---|---|")
    n = exact = one = 0
    for job, jr in results["jobs"].items():
        d = jr.get(key, {})
        for a in ("native", "expandable", "gpumem"):
            c = jr.get("cap", {}).get(a)
            if not c:
                continue
            truth = c["largest"] if c["bound"] == "exact" else None
            lb = d.get("largest", {}).get(ROW[a])
            g = grid_floor(lb)
            off = GRID.index(g) - GRID.index(truth) if g and truth else None
            n += 1
            exact += off == 0
            one += off is not None and abs(off) <= 1
            out.append("| %s | %s | %s | %s | %s | %d |" % (
                job, a, c["largest"] if truth else "%s (%s)" % (c["largest"], c["bound"]),
                "-" if lb is None else "%s (grid %s)" % (lb, g), "-" if off is None else "%+d" % off,
                len(d.get("recordings", []))))
    out.append("")
    out.append("At the batches: %d of %d exact on the grid, %d within one step.\n" % (exact, n, one))
    return "\n".join(out)


def report(results):
    out = []
    frac, cap = results["fraction"], results["cap_bytes"]
    out.append("Recorded at batch %s (%d steps each); device %.1f GiB; cap %.2f of it = %.2f GiB.\n" % (
        ",".join(map(str, results["sizes"])), results["steps"], results["device_total"] / GIB, frac, cap / GIB))
    out.append("### Peak reserved (GiB): measured, and the error of the prediction from the GPU recordings "
               "(and, for native, from the CPU recorder)\n")
    out.append("| job | batch | native | from GPU | from CPU | expandable | from GPU | gpumem | from GPU |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    gpu_errs, cpu_errs = [], []
    for r in peak_rows(results):
        cells = [r["job"], str(r["batch"])]
        for a in ("native", "expandable", "gpumem"):
            if r[a] is None:
                cells += [r[a + "_why"] or "-", "-"] + (["-"] if a == "native" else [])
                continue
            e = err(r[a + "_gpu"], r[a])
            gpu_errs.append((r["job"], r["batch"], a, e))
            cells += [gib(r[a]), pct(e)]
            if a == "native":
                ec = err(r["native_cpu"], r[a])
                cpu_errs.append((r["job"], r["batch"], ec))
                cells.append(pct(ec))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    ok = [x for x in gpu_errs if x[3] is not None and abs(x[3]) <= 0.02]
    has_gpu = any("predicted_gpu" in jr for jr in results["jobs"].values())
    if has_gpu:
        out.append("From GPU recordings: %d of %d measured peaks predicted within 2%%." % (len(ok), len(gpu_errs)))
    misses = [x for x in gpu_errs if has_gpu and (x[3] is None or abs(x[3]) > 0.02)]
    for job, b, a, e in misses:
        out.append("- miss: %s batch %d %s: %s" % (job, b, a, pct(e) if e is not None else "no prediction"))
    c5 = [x for x in cpu_errs if x[2] is not None and abs(x[2]) <= 0.05]
    c10 = [x for x in cpu_errs if x[2] is not None and abs(x[2]) <= 0.10]
    has_cpu = any("predicted_cpu" in jr for jr in results["jobs"].values())
    if has_cpu:
        out.append("From the CPU recorder (native): %d of %d within 5%%, %d within 10%%." % (
            len(c5), len(cpu_errs), len(c10)))
    for job, b, e in cpu_errs if has_cpu else []:
        if e is None or abs(e) > 0.05:
            out.append("- over 5%%: %s batch %d: %s" % (job, b, pct(e) if e is not None else "no prediction"))
    out.append("")

    out.append("### Largest batch under the cap (grid of ~10%% steps; %.2f GiB)\n" % (cap / GIB))
    out.append("| job | allocator | measured | predicted from GPU | steps off | predicted from CPU | steps off |")
    out.append("|---|---|---|---|---|---|---|")
    n = exact = one = cn = c_one = 0
    for job, jr in results["jobs"].items():
        for a in ("native", "expandable", "gpumem"):
            c = jr.get("cap", {}).get(a)
            if not c:
                continue
            truth = c["largest"] if c["bound"] == "exact" else None
            cells = [job, a, str(c["largest"]) if truth else "%s (%s)" % (c["largest"], c["bound"])]
            for src in ("gpu", "cpu"):
                lb = jr.get("predicted_" + src, {}).get("largest", {}).get(ROW[a])
                g = grid_floor(lb)
                off = GRID.index(g) - GRID.index(truth) if g and truth else None
                cells += ["-" if lb is None else "%s (grid %s)" % (lb, g), "-" if off is None else "%+d" % off]
                if src == "gpu":
                    n += 1
                    exact += off == 0
                    one += off is not None and abs(off) <= 1
                elif a == "native":
                    cn += 1
                    c_one += off is not None and abs(off) <= 1
            out.append("| " + " | ".join(cells) + " |")
    out.append("")
    if has_gpu:
        out.append("From GPU recordings: %d of %d exact on the grid, %d within one step." % (exact, n, one))
    if has_cpu:
        out.append("From the CPU recorder (native): %d of %d within one step." % (c_one, cn))
    out.append("")

    for key in DIRECT_TITLES:
        if any(key in jr for jr in results["jobs"].values()):
            out.append(direct_report(results, key))

    out.append("### PyTorch's MemTracker against the measured native peak reserved\n")
    out.append("| job | batch | measured native (GiB) | MemTracker (GiB) | error |")
    out.append("|---|---|---|---|---|")
    for job, jr in results["jobs"].items():
        mt = jr.get("memtracker")
        if not mt:
            continue
        m, _ = measured_peak(jr.get("measured", {}).get(str(mt["batch"]), {}).get("native"))
        if mt.get("error"):
            cell, e = "raised %s" % mt["error"].replace("|", "/"), "-"
        else:
            cell, e = gib(mt.get("peak_bytes")), pct(err(mt.get("peak_bytes"), m))
        out.append("| %s | %d | %s | %s | %s |" % (job, mt["batch"], gib(m), cell, e))
    out.append("")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.stdout.write(report(json.load(f)))
