"""The tables of a prediction's first try (bench/torch/first_try.sh): for
each job and each way of recording it at batch 1 and 2 (PyTorch's snapshot
pickles, `python -m gpumem.predict`'s GPU runs, the CPU recorder), whether
the recordings aligned with no check recordings, what only one batch made,
and the peak reserved `gpumem predict` gives at the target batch under
PyTorch's allocator, expandable segments and gpumem, against the peak the
job reserved when run there.

    python3 bench/torch/first_try_report.py OUTDIR [--gpumem BUILD/gpumem] [--json FILE]
        [--targets 16,64,256] [--measured-from RESULTS.json]

--measured-from takes the runs from bench/torch/predict_accuracy.py's
results.json (its jobs' "measured" figures at each target) instead of
OUTDIR/measured/: the same jobs run on the GPU earlier, with the same
software. Prints markdown. The figures are what the files say; nothing is
assumed.
"""

import argparse
import glob
import json
import os
import subprocess
import sys

GIB = 2**30
ROUTES = (("snapshot", "{out}/{job}.b{b}.pickle.gz"), ("gpu", "{out}/gpu/{job}_b{b}/trace"),
          ("cpu", "{out}/cpu/{job}_b{b}/trace"))  # fmt: skip
ALLOCATORS = (("native", "pytorch"), ("expandable", "pytorch expandable"), ("gpumem", "gpumem default"))


def predict(binary, sizes, paths, target):
    """`gpumem predict --batch-sizes SIZES ... --batch target --json`: (its
    object, or None, and the error's first line)."""
    done = subprocess.run([binary, "predict", "--batch-sizes", ",".join(map(str, sizes))] + paths + ["--batch", str(target), "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    if done.returncode != 0:
        return None, done.stderr.decode("utf-8", "replace").strip().splitlines()[0][:300]
    return json.loads(done.stdout), None


def measured(out, job, target, results=None):
    """{allocator: peak reserved bytes} of the runs at target (None where a
    run failed or ran out): OUTDIR/measured/, or a results.json's."""
    got = {}
    for a, _ in ALLOCATORS:
        try:
            if results is not None:
                r = results["jobs"][job]["measured"][str(target)][a]
            else:
                with open(os.path.join(out, "measured", "%s.b%d.%s.json" % (job, target, a))) as f:
                    r = json.load(f)
            got[a] = None if r.get("oom") else r.get("peak_reserved")
        except (OSError, ValueError, KeyError):
            got[a] = None
    return got


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--gpumem", default=os.path.join(os.path.dirname(__file__), "..", "..", "build", "gpumem"))
    ap.add_argument("--targets", default="16", help="batches predicted at (default 16)")
    ap.add_argument("--sizes", default="1,2", help="the two small batches recorded (default 1,2)")
    ap.add_argument("--measured-from", help="a predict_accuracy.py results.json with the runs")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args(argv)
    targets = [int(t) for t in a.targets.split(",")]
    sizes = [int(b) for b in a.sizes.split(",")]
    results = None
    if a.measured_from:
        with open(a.measured_from) as f:
            results = json.load(f)
    jobs = sorted({os.path.basename(p).split(".b")[0] for p in glob.glob(os.path.join(a.out, "*.pickle.gz"))} |
                  {os.path.basename(p).rsplit("_b", 1)[0] for p in glob.glob(os.path.join(a.out, "cpu", "*_b%d" % sizes[0]))})
    rows = []
    for job in jobs:
        for target in targets:
            runs = measured(a.out, job, target, results)
            for route, pattern in ROUTES:
                paths = [pattern.format(out=a.out, job=job, b=b) for b in sizes]
                row = {"job": job, "route": route, "target": target, "measured": runs}
                if not all(os.path.exists(p) for p in paths):
                    continue
                doc, err = predict(a.gpumem, sizes, paths, target)
                if doc is None:
                    row["error"] = err
                    rows.append(row)
                    continue
                al = doc.get("aligned", {})
                row.update(aligned=al, allocations=doc.get("allocations"))
                peaks = {r["allocator"]: r.get("peak_reserved_bytes") for r in doc.get("allocators", [])}
                row["predicted"] = {a_: peaks.get(name) for a_, name in ALLOCATORS}
                rows.append(row)
    print("| job | recorded as | batch | aligned | only at %d | only at %d | frees moved | %s |" %
          (sizes[1], sizes[0], " | ".join("%s: predicted / ran" % a_ for a_, _ in ALLOCATORS)))  # fmt: skip
    print("|---|---|---|---|---|---|---|%s" % ("---|" * len(ALLOCATORS)))
    within = {a_: [0, 0] for a_, _ in ALLOCATORS}
    for r in rows:
        if "error" in r:
            print("| %s | %s | %d | no: %s | | | |%s" % (r["job"], r["route"], r["target"],
                                                        r["error"].replace("|", "/"), " |" * len(ALLOCATORS)))
            continue
        al = r["aligned"]
        cells = []
        for a_, _ in ALLOCATORS:
            p, m = r["predicted"].get(a_), r["measured"].get(a_)
            if p is None:
                cells.append("-")
            elif m is None:
                cells.append("%.3f / -" % (p / GIB))
            else:
                off = 100.0 * (p - m) / m
                within[a_][0] += abs(off) <= 2.0
                within[a_][1] += 1
                cells.append("%.3f / %.3f (%+.2f%%)" % (p / GIB, m / GIB, off))
        print("| %s | %s | %d | yes, %s of %s | %d (%.1f MiB) | %d (%.1f MiB) | %d | %s |" % (
            r["job"], r["route"], r["target"], al.get("matched"), r.get("allocations"), al.get("inserted", 0),
            al.get("inserted_bytes_at_largest", 0) / 2**20, al.get("dropped", 0), al.get("dropped_bytes", 0) / 2**20,
            al.get("frees_moved", 0), " | ".join(cells)))  # fmt: skip
    print()
    print("Within 2%%: %s." % ", ".join("%s %d of %d" % (a_, w[0], w[1]) for a_, w in within.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
