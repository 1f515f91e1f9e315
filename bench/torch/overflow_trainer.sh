#!/usr/bin/env bash
# The overflow tier under a real client, the HF Trainer
# (bench/torch/userjobs/trainer_bert.py at batch 32): uncapped, then capped
# at the uncapped peak reserved / 1.10 and / 1.25 with and without
# `overflow:host`, and the Trainer's own batch-size search
# (auto_find_batch_size, from 64) under the / 1.10 cap with and without the
# tier (10 steps; FIND_TIMEOUT, default 80 s, stops the second). Each run a
# fresh process (bench/torch/measure_script.py):
# OUTDIR/NAME.json with peak reserved, wall time, the tier's counts; the
# batch the Trainer trained at is the log's last line.
#
#   bash bench/torch/overflow_trainer.sh BUILD OUTDIR [STEPS]
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
out="${2:?usage: overflow_trainer.sh BUILD OUTDIR [STEPS]}"
steps="${3:-30}"
need_library overflow_trainer.sh
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
job="$root/bench/torch/userjobs/trainer_bert.py"
run() {  # NAME CONF ARGS...
  local name=$1 conf=$2
  shift 2
  GPUMEM_CONF="$conf" timeout "${RUN_TIMEOUT:-120}" "$py" "$root/bench/torch/measure_script.py" --allocator gpumem \
    --json "$out/$name.json" "$job" --steps "$steps" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? $(tail -n 2 "$out/$name.log" | head -c 600)"
}
run uncapped "" --batch-size 32
peak=$("$py" -c "import json; print(json.load(open('$out/uncapped.json'))['peak_reserved'])")
for cap in 1.10 1.25; do
  limit=$("$py" -c "print(int($peak / $cap))")
  run "cap$cap" "limit:$limit" --batch-size 32
  run "cap$cap.overflow" "limit:$limit,overflow:host" --batch-size 32
done
limit=$("$py" -c "print(int($peak / 1.10))")
steps=10
run "find.cap1.10" "limit:$limit" --batch-size 64 --auto-find-batch-size
RUN_TIMEOUT=${FIND_TIMEOUT:-80} run "find.cap1.10.overflow" "limit:$limit,overflow:host" --batch-size 64 --auto-find-batch-size
