#!/usr/bin/env bash
# The what-if checks on a GPU: each workload run under gpumem with recording
# on (policies default and pytorch), natively with PyTorch's snapshot history
# (its own allocator, then with expandable segments) and under
# cudaMallocAsync; then gpumem replays every recording without the GPU and
# bench/torch/whatif_check.py prints PASS/FAIL beside the measured peaks.
#
#   make build && bash bench/torch/whatif.sh [BUILD_DIR]
#
# Knobs: WORKLOADS (default: gpt2_train resnet50_train llama_ckpt_train
# t5_varlen_prefetch), STEPS=3, WARMUP=1, OUT (results; default
# build/whatif). LOCKSTEP=1 also measures what recording costs a step, per
# workload: bench/torch/lockstep_ab.py trains gpumem and gpumem with
# record:... in turns on the GPU (LOCKSTEP_STEPS=60 step pairs after 8
# warm-up steps) and whatif_check.py --recording-cost says PASS when the
# ratio of their median step times is at most 1.01; LOCKSTEP=only measures
# that alone.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
need_library whatif
WORKLOADS="${WORKLOADS:-gpt2_train resnet50_train llama_ckpt_train t5_varlen_prefetch}"
out="${OUT:-$build/whatif}"
mkdir -p "$out"
rc=0
[ "${LOCKSTEP:-0}" = only ] || for w in $WORKLOADS; do
  for mode in gpumem-default gpumem-pytorch native expandable async; do
    timeout "${RUN_TIMEOUT:-300}" "$py" "$root/bench/torch/whatif_run.py" "$out" "$w" "$mode" \
      --steps "${STEPS:-3}" --warmup "${WARMUP:-1}" >>"$out/runs.log" 2>&1 ||
      echo "whatif: $w $mode failed (exit $?; $out/runs.log)" >&2
    tail -n 1 "$out/runs.log"
  done
done
# the recordings are large: keep only the logs and figures in $OUT's top
if [ "${LOCKSTEP:-0}" != only ]; then
  "$py" "$root/bench/torch/whatif_check.py" "$build" "$out" $WORKLOADS | tee "$out/check.txt"
  rc=${PIPESTATUS[0]}
fi
if [ "${LOCKSTEP:-0}" != 0 ]; then
  # the recordings are large: written to a directory of their own, each
  # deleted after its run
  rec=$(mktemp -d "${TMPDIR:-/tmp}/gpumem-whatif.XXXXXX") || exit 1
  trap 'rm -rf "$rec"' EXIT
  for w in $WORKLOADS; do
    "$py" "$root/bench/torch/lockstep_ab.py" "$w" --steps "${LOCKSTEP_STEPS:-60}" --warmup 8 \
      --sides gpumem "gpumem+record:$rec/$w-%p.trace.gz" --pairs 1/0 \
      --out "$out/lockstep_record.jsonl" |
      "$py" "$root/bench/torch/whatif_check.py" --recording-cost "$w" | tee -a "$out/check.txt"
    [ "${PIPESTATUS[1]}" = 0 ] || rc=1
    rm -f "$rec"/*.trace.gz
  done
fi
exit "$rc"
