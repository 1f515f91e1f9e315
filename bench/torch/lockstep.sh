#!/usr/bin/env bash
# Step times of native PyTorch and gpumem, trained in turns step by step on
# one GPU (bench/torch/lockstep_ab.py), for each workload; one JSON line per
# workload on stdout and appended to $OUT/lockstep.jsonl when OUT is set.
#
#   bash bench/torch/lockstep.sh [BUILD_DIR]          (default: build)
#
# Knobs (environment): WORKLOADS (default: all four), STEPS=60 timed steps,
# T5_STEPS=280 for t5_varlen_prefetch (its steps follow the host's noise:
# ~0.15 sd of the per-step log ratio on the H200 host of 2026-11-26),
# WARMUP=8 (the plan serves before the first timed step), RUN_TIMEOUT=400 (per run),
# RUNS=1 (more: each run with fresh processes, then a line with the interval
# over runs, lockstep_ab.py --runs), PIN=1 (each side on CPUs of its own).
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
need_library lockstep
WORKLOADS="${WORKLOADS:-gpt2_train resnet50_train llama_ckpt_train t5_varlen_prefetch}"
out_args=()
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  out_args=(--out "$OUT/lockstep.jsonl")
fi
for w in $WORKLOADS; do
  steps="${STEPS:-60}"
  [ "$w" = t5_varlen_prefetch ] && steps="${T5_STEPS:-280}"
  runs="${RUNS:-1}"
  extra=()
  [ "${PIN:-0}" = 1 ] && extra+=(--pin)
  timeout "$(( ${RUN_TIMEOUT:-400} * runs ))" "$py" "$root/bench/torch/lockstep_ab.py" "$w" --steps "$steps" \
    --warmup "${WARMUP:-8}" --runs "$runs" "${extra[@]}" "${out_args[@]}" || echo "lockstep: $w failed (exit $?)" >&2
done
