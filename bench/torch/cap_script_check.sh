#!/usr/bin/env bash
# The largest batch `python -m gpumem.predict` gave for a script, run: the
# script at each allocator's predicted largest batch, which should fit, and
# at one 10% step above it, which should run out of memory. For scripts
# that cap themselves (set_per_process_memory_fraction) or a card's memory.
#
#   bash bench/torch/cap_script_check.sh BUILD OUTDIR PREDICTION.txt SCRIPT
#
# PREDICTION.txt is the command's output (bench/torch/scripts_check.sh
# writes OUTDIR/NAME.gpu.txt). Each run is bench/torch/measure_script.py for
# STEPS (5) steps: OUTDIR/NAME.cap.ALLOCATOR.BATCH.json, and a table on
# stdout (OUTDIR/NAME.cap.md).
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
out="${2:?usage: cap_script_check.sh BUILD OUTDIR PREDICTION.txt SCRIPT}"
prediction="${3:?usage: cap_script_check.sh BUILD OUTDIR PREDICTION.txt SCRIPT}"
script="${4:?usage: cap_script_check.sh BUILD OUTDIR PREDICTION.txt SCRIPT}"
need_library cap_script_check.sh
steps="${STEPS:-5}"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
n=$(basename "$script" .py)
mkdir -p "$out"
{
  echo "| allocator | predicted largest batch | at it | one step above | at that |"
  echo "|---|---|---|---|---|"
  for pair in native:pytorch expandable:"pytorch expandable" gpumem:"gpumem default"; do
    a=${pair%%:*}
    row=${pair#*:}
    # the row's first figure after its name: "gpumem default   7979   12.345 GiB"
    b=$(awk -v row="$row" 'index($0, row) == 1 { rest = substr($0, length(row) + 1)
                                                if (rest ~ /^[ \t]+[0-9]/) { split(rest, f); print f[1] + 0; exit } }' "$prediction")
    if [ -z "$b" ] || [ "$b" -le 0 ]; then
      echo "| $a | not in $prediction | | | |"
      continue
    fi
    above=$(((b * 11 + 9) / 10))
    results=()
    for batch in "$b" "$above"; do
      j="$out/$n.cap.$a.$batch.json"
      "$py" "$root/bench/torch/measure_script.py" --allocator "$a" --json "$j" \
        "$script" --batch-size "$batch" --steps "$steps" > "$out/$n.cap.$a.$batch.log" 2>&1
      results+=("$("$py" -c 'import json, sys
try:
    m = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("no result (see the log)"); sys.exit()
print("out of memory" if m["oom"] else "fits, peak reserved %.3f GiB" % (m["peak_reserved"] / 2**30))' "$j")")
    done
    echo "| $a | $b | ${results[0]} | $above | ${results[1]} |"
  done
} | tee "$out/$n.cap.md"
