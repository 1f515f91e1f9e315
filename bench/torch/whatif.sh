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
# build/whatif). LOCKSTEP=1 also measures what recording costs a step:
# bench/torch/lockstep_ab.py with and without record:..., gpumem / native.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
need_library whatif
WORKLOADS="${WORKLOADS:-gpt2_train resnet50_train llama_ckpt_train t5_varlen_prefetch}"
out="${OUT:-$build/whatif}"
mkdir -p "$out"
for w in $WORKLOADS; do
  for mode in gpumem-default gpumem-pytorch native expandable async; do
    timeout "${RUN_TIMEOUT:-300}" "$py" "$root/bench/torch/whatif_run.py" "$out" "$w" "$mode" \
      --steps "${STEPS:-3}" --warmup "${WARMUP:-1}" >>"$out/runs.log" 2>&1 ||
      echo "whatif: $w $mode failed (exit $?; $out/runs.log)" >&2
    tail -n 1 "$out/runs.log"
  done
done
# the recordings are large: keep only the logs and figures in $OUT's top
"$py" "$root/bench/torch/whatif_check.py" "$build" "$out" $WORKLOADS | tee "$out/check.txt"
rc=${PIPESTATUS[0]}
if [ "${LOCKSTEP:-0}" = 1 ]; then
  for w in $WORKLOADS; do
    for conf in "" "record:/tmp/gpumem-whatif-%p.trace.gz"; do
      "$py" "$root/bench/torch/lockstep_ab.py" "$w" --steps "${LOCKSTEP_STEPS:-60}" --warmup 8 \
        ${conf:+--conf "$conf"} --out "$out/lockstep_record.jsonl" | "$py" -c '
import json, sys
d = json.loads(sys.stdin.read().strip().splitlines()[-1])
print("lockstep", d["workload"], "conf=%r" % d["conf"], "gpumem/native median ratio",
      d.get("ratio_of_medians"), "geo mean", d.get("geo_mean_step_ratio"), d.get("step_ratio_ci95"))'
    done
  done
  rm -f /tmp/gpumem-whatif-*.trace.gz
fi
exit "$rc"
