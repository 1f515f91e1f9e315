#!/usr/bin/env bash
# A prediction's first try, on the GPU machine: each job of
# bench/torch/predict_jobs.py recorded at batch 1 and 2 (or SIZES) the three ways a
# user can (PyTorch's own snapshot pickle; `python -m gpumem.predict` on the
# GPU, its history with Python frames; the CPU recorder on fake tensors),
# and run at TARGET under PyTorch's allocator, expandable segments and
# gpumem for the peak each reserved. bench/torch/first_try_report.py then
# aligns and predicts from each pair of recordings and sets the predictions
# beside the runs.
#
#   bash bench/torch/first_try.sh BUILD OUTDIR [JOB...]
#
# Environment: TARGET (16), SIZES (the two small batches recorded, "1 2"),
# STEPS (training steps of each recording, 3), ROUTES (which recordings to
# make, "snap gpu cpu"), PARALLEL (8 processes at once; each process's
# peaks are its own), RUN_TIMEOUT (300 s), PROFILE (the device profile the
# CPU recorder uses: a name or a path; default auto). OUTDIR gets
# JOB.bB.pickle.gz, gpu/JOB_bB/trace, cpu/JOB_bB/trace (with meta.json) and
# measured/JOB.bTARGET.ALLOCATOR.json.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
out="${2:?usage: first_try.sh BUILD OUTDIR [JOB...]}"
shift 2
need_library first_try.sh
mkdir -p "$out/gpu" "$out/cpu" "$out/measured" "$out/logs"
if [ $# -eq 0 ]; then
  set -- gpt2 llama bert t5 vit resnet50 convnext llama_lora bert_scaler gpt2_generate resnet_sgd
fi
target="${TARGET:-16}"
sizes="${SIZES:-1 2}"
steps="${STEPS:-3}"
routes="${ROUTES:-snap gpu cpu}"
timeout_s="${RUN_TIMEOUT:-300}"
profile="${PROFILE:-auto}"
jobs_py="$root/bench/torch/predict_jobs.py"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
if [ "$profile" = auto ]; then
  profile=$("$py" -c "
import torch
from gpumem.predict import profiles
print(profiles.choose('auto', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, torch.__version__)[0].path)")
fi
echo "first_try: CPU recorder profile $profile"
{
  for j in "$@"; do
    for b in $sizes; do
      for r in $routes; do echo "$r $j $b"; done
    done
  done
  for a in native expandable gpumem; do
    for j in "$@"; do echo "measure $j $target $a"; done
  done
} | STEPS="$steps" xargs -P "${PARALLEL:-8}" -L 1 sh -c '
  kind=$0 j=$1 b=$2 a=${3:-}
  log="'"$out"'/logs/$kind.$j.b$b$a.log"
  case $kind in
    snap) timeout '"$timeout_s"' "'"$py"'" "'"$jobs_py"'" "$j" --batch-size "$b" --steps "$STEPS" --snapshot "'"$out"'/$j.b$b.pickle.gz" >"$log" 2>&1 ;;
    gpu|cpu)
      d="'"$out"'/$kind/${j}_b$b"; mkdir -p "$d"; chmod 700 "$d"
      [ $kind = cpu ] && export CUDA_VISIBLE_DEVICES=
      timeout '"$timeout_s"' "'"$py"'" -m gpumem.predict._child "$kind" "$d" "$STEPS" "'"$profile"'" "'"$jobs_py"'" "$j" --batch-size "$b" >"$log" 2>&1 ;;
    measure) timeout '"$timeout_s"' "'"$py"'" "'"$jobs_py"'" "$j" --batch-size "$b" --steps "$STEPS" --allocator "$a" --json "'"$out"'/measured/$j.b$b.$a.json" >"$log" 2>&1 ;;
  esac || echo "first_try: $kind $j batch $b $a failed (exit $?): $log"'
echo "first_try: $(ls "$out"/*.pickle.gz 2>/dev/null | wc -l) snapshots, $(ls "$out"/gpu/*/trace 2>/dev/null | wc -l) GPU and $(ls "$out"/cpu/*/trace 2>/dev/null | wc -l) CPU recordings, $(ls "$out"/measured/*.json 2>/dev/null | wc -l) runs measured"
