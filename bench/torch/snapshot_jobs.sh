#!/usr/bin/env bash
# PyTorch's own memory snapshots of the jobs of bench/torch/predict_jobs.py
# at small batches, and each job's measured peak reserved at a larger one
# under PyTorch's allocator, expandable segments and gpumem: what `gpumem
# predict` is held to when it is given the pickles a user records
# (docs/predict.md, "From PyTorch's snapshots").
#
#   bash bench/torch/snapshot_jobs.sh BUILD OUTDIR [JOB...]
#
# Environment: SIZES (default "1 2 4": the batches recorded), TARGET (16:
# the batch measured), PARALLEL (8 processes at once; each process's peaks
# are its own), RUN_TIMEOUT (300 s). OUTDIR gets JOB.bB.pickle.gz per
# recording, JOB.bB.ALLOCATOR.json per measurement, and measured.jsonl
# (every JSON line the runs printed).
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
out="${2:?usage: snapshot_jobs.sh BUILD OUTDIR [JOB...]}"
shift 2
need_library snapshot_jobs.sh
mkdir -p "$out"
if [ $# -eq 0 ]; then
  set -- gpt2 llama bert t5 vit resnet50 convnext llama_lora bert_scaler gpt2_generate resnet_sgd
fi
sizes="${SIZES:-1 2 4}"
target="${TARGET:-16}"
timeout_s="${RUN_TIMEOUT:-300}"
jobs_py="$root/bench/torch/predict_jobs.py"
{
  for j in "$@"; do
    for b in $sizes; do echo "$j $b native --snapshot $out/$j.b$b.pickle.gz"; done
  done
  for a in native expandable gpumem; do
    for j in "$@"; do echo "$j $target $a --json $out/$j.b$target.$a.json"; done
  done
} | xargs -P "${PARALLEL:-8}" -L 1 sh -c \
  'timeout '"$timeout_s"' "$0" "'"$jobs_py"'" "$1" --batch-size "$2" --allocator "$3" "$4" "$5" \
     >"'"$out"'/$1.b$2.$3.log" 2>&1 || echo "$1 batch $2 $3: failed (exit $?)"' "$py"
cat "$out"/*.json >"$out/measured.jsonl" 2>/dev/null
echo "snapshot_jobs: $(ls "$out"/*.pickle.gz 2>/dev/null | wc -l) snapshots, $(ls "$out"/*.json 2>/dev/null | wc -l) measurements in $out"
