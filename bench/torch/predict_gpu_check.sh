#!/usr/bin/env bash
# How right `python -m gpumem.predict` is on a GPU machine, in three passes
# of bench/torch/predict_accuracy.py over one OUTDIR:
#
#   bash bench/torch/predict_gpu_check.sh OUTDIR [MEASURED.json]
#
# 1. record, predict: each job at batch 2 and 4 on the GPU, scaled to the
#    targets and to the largest batch under the cap; MEASURED.json (an
#    earlier run's results.json on the same GPU and software) supplies the
#    measured peaks and largest batches to set them against;
# 2. measure (gpumem only: $MEASURE, default gpumem; "native,expandable,
#    gpumem" for all three): each job at each target in a process of its
#    own, torch.cuda.max_memory_reserved;
# 3. probe: fake tensors at each target and around each predicted largest
#    batch, each convolution run for real on the GPU (what the command's
#    check does there), replayed with `gpumem fit`.
#
# Environment: JOBS (comma-separated; default every job of predict_jobs.py),
# FINISH_BY (a time, in seconds since the epoch, by which the probe pass is
# to be done: it starts no run later than 100 s before; default no limit).
# OUTDIR/summary.md gets the tables, OUTDIR/results.json the figures.
set -euo pipefail
out="${1:?usage: predict_gpu_check.sh OUTDIR [MEASURED.json]}"
measured="${2:-}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
make -C "$root" build >/dev/null
acc=(python3 "$root/bench/torch/predict_accuracy.py" "$out")
[ -n "${JOBS:-}" ] && acc+=(--jobs "$JOBS")
"${acc[@]}" --phases record,predict ${measured:+--measured "$measured"} >/dev/null
"${acc[@]}" --phases measure --measure-allocators "${MEASURE:-gpumem}" >/dev/null
deadline=1e9
[ -n "${FINISH_BY:-}" ] && deadline=$((FINISH_BY - $(date +%s) - 100))
"${acc[@]}" --phases probe --deadline "$deadline"
