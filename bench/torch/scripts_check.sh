#!/usr/bin/env bash
# `python -m gpumem.predict` with default flags on scripts as their users
# write them (bench/torch/userjobs/: the HF Trainer, Lightning, plain loops),
# against the same scripts run at the batch asked for, on this machine's GPU.
#
#   bash bench/torch/scripts_check.sh BUILD OUTDIR [SCRIPT...]
#
# For each script: the prediction at TARGET (default 32, 16 times the larger
# of the default recordings at 1 and 2) on the GPU (OUTDIR/NAME.gpu.txt) and
# on the CPU recorder with this GPU's profile (NAME.cpu.txt), then the
# script run at TARGET for STEPS (10) steps under PyTorch's allocator,
# expandable segments and gpumem (NAME.ALLOCATOR.json, by
# bench/torch/measure_script.py), and a table of predicted against measured
# peak reserved (OUTDIR/table.md). Scripts take --batch-size and --steps.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
out="${2:?usage: scripts_check.sh BUILD OUTDIR [SCRIPT...]}"
shift 2
need_library scripts_check.sh
if [ $# -eq 0 ]; then
  set -- "$root"/bench/torch/userjobs/trainer_bert.py "$root"/bench/torch/userjobs/lightning_gpt2.py
fi
target="${TARGET:-32}"
steps="${STEPS:-10}"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
for s in "$@"; do
  n=$(basename "$s" .py)
  (
    for route in gpu cpu; do
      flag=; [ $route = cpu ] && flag=--cpu
      t0=$SECONDS
      "$py" -m gpumem.predict --memory 79G --batch "$target" $flag "$s" --batch-size '{B}' --steps 3 \
        > "$out/$n.$route.txt" 2>&1
      echo "exit $? wall $((SECONDS - t0)) s" >> "$out/$n.$route.txt"
    done
    for a in native expandable gpumem; do
      "$py" "$root/bench/torch/measure_script.py" --allocator $a --json "$out/$n.$a.json" \
        "$s" --batch-size "$target" --steps "$steps" > "$out/$n.$a.log" 2>&1 || echo "$n $a: exit $?" >&2
    done
  ) &
done
wait
"$py" "$root/bench/torch/scripts_report.py" "$out" "$target" "$@" | tee "$out/table.md"
