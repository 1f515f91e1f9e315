#!/usr/bin/env bash
# Two-GPU training (FSDP2, DDP) under PyTorch's native allocator, expandable
# segments and gpumem, each side its own torchrun job of 2 ranks, the sides
# trained in turns step by step on the same GPUs (bench/torch/multigpu.py says
# what is measured and what passes).
#
#   bash bench/torch/multigpu.sh [BUILD_DIR]          (default: build)
#
# Knobs (environment): STRATEGIES="fsdp2 ddp", SIDES=native,expandable,gpumem,
# STEPS=40 timed steps, WARMUP=6, VARLEN=0 (1: a sequence length per step),
# DETERMINISTIC=1 (losses compared step for step), NPROC=2, RUN_TIMEOUT=540
# seconds per strategy, OUT (default BUILD_DIR/multigpu): OUT/STRATEGY/ gets
# result.json, result.txt and each side's log. Prints the tables; exits
# non-zero when a run errored (a side died or timed out), not when a PASS/FAIL
# check failed. Without 2 GPUs: "skipped", exit 0.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off (NCCL, PyTorch, NVSHMEM): multigpu.py sets these
# for its jobs too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

STRATEGIES="${STRATEGIES:-fsdp2 ddp}"
SIDES="${SIDES:-native,expandable,gpumem}"
NPROC="${NPROC:-2}"
OUT="${OUT:-$build/multigpu}"

gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1)
case "$gpus" in '' | *[!0-9]*) gpus=0 ;; esac
if [ "$gpus" -lt "$NPROC" ]; then
  echo "multigpu: skipped: needs $NPROC GPUs (found $gpus)"
  exit 0
fi
case ",$SIDES," in
  *,gpumem,*)
    need_library multigpu
    # gpumem's PyTorch allocator library is compiled against the installed
    # torch on first use: once here, not by every rank inside the timed run.
    "$py" -c 'import gpumem.torch as t; p, why = t.build_graphs_shim(); print("multigpu: gpumem full allocator:", p or why)' ||
      echo "multigpu: could not prepare gpumem's PyTorch library (the ranks will try again)" >&2
    ;;
esac

flags=(--sides "$SIDES" --steps "${STEPS:-40}" --warmup "${WARMUP:-6}" --nproc "$NPROC"
  --timeout "${RUN_TIMEOUT:-540}")
[ "${VARLEN:-0}" = 1 ] && flags+=(--varlen)
[ "${DETERMINISTIC:-1}" = 1 ] && flags+=(--deterministic)

status=0
for s in $STRATEGIES; do
  mkdir -p "$OUT/$s"
  "$py" "$root/bench/torch/multigpu.py" run --strategy "$s" "${flags[@]}" --out "$OUT/$s"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "multigpu: $s: ERROR (exit $rc; logs in $OUT/$s)" >&2
    status=1
  fi
done
exit "$status"
