#!/usr/bin/env bash
# Records the serving and variable-shape jobs of traces/jobs/ on a GPU and
# measures each one's peak reserved memory under PyTorch's three
# allocators (bench/torch/record_jobs.py says what each run writes).
#
#   bash bench/torch/record_jobs.sh OUTDIR [WORKLOAD...]     (default: all of record_jobs.py's STEPS)
#
# Runs PARALLEL processes at once (default 4; each job's peaks are its own
# process's, so jobs sharing the GPU do not change them), each stopped after
# RUN_TIMEOUT seconds (default 240). OUTDIR gets WORKLOAD.trace.gz and a JSON
# file per run, and summary.txt: per job, peak allocated and peak reserved
# under native, expandable segments and cudaMallocAsync.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" ""
out="${1:?usage: record_jobs.sh OUTDIR [WORKLOAD...]}"
shift
mkdir -p "$out"
if [ $# -eq 0 ]; then
  set -- $("$py" -c "import sys; sys.path.insert(0, '$root/bench/torch'); import record_jobs; print(' '.join(record_jobs.STEPS))")
fi
parallel="${PARALLEL:-4}"
timeout_s="${RUN_TIMEOUT:-240}"
# (modes outermost: the four runs of one job, which need the same memory,
# do not all run at once)
for mode in record native expandable async; do
  for w in "$@"; do
    echo "$w $mode"
  done
done | xargs -P "$parallel" -L 1 sh -c \
  'timeout '"$timeout_s"' "$0" "'"$root"'/bench/torch/record_jobs.py" "$1" "'"$out"'" --mode "$2" \
     >"'"$out"'/$1.$2.log" 2>&1 || echo "$1 $2: failed (exit $?), see '"$out"'/$1.$2.log"' "$py"
"$py" - "$out" "$@" <<'PY' | tee "$out/summary.txt"
import json, os, sys
out, jobs = sys.argv[1], sys.argv[2:]
gib = 2**30
print("%-22s %10s | %-22s %-22s %-22s %-22s" % ("job", "peak alloc", "record", "native", "expandable", "async"))
for w in jobs:
    cells, alloc = [], None
    for mode in ("record", "native", "expandable", "async"):
        try:
            r = json.load(open(os.path.join(out, "%s.%s.json" % (w, mode))))
        except OSError:
            cells.append("-")
            continue
        alloc = alloc or r["peak_allocated"]
        cells.append("%.3f GiB (%.3fx)%s" % (r["peak_reserved"] / gib, r["peak_reserved"] / r["peak_allocated"],
                                             " R" if r.get("num_alloc_retries") else ""))
    print("%-22s %10s | %-22s %-22s %-22s %-22s" % (w, "%.3f GiB" % (alloc / gib) if alloc else "-", *cells))
PY
