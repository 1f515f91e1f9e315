#!/usr/bin/env bash
# Out of memory the way the ecosystem expects it, on a GPU machine: the GPU
# suite's out-of-memory tests (PyTorch's message, observers, num_ooms,
# recovery, graphs and MemPools, native and gpumem side by side), the
# micro-batch helper (bench/torch/oom_finders.py microbatch) and the
# batch-size finders (oom_finders.py all). Results go to $OUT (default
# build/oom-results): the test log and oom_finders.jsonl.
#
#   bash bench/torch/oom_gpu.sh [tests] [microbatch] [finders]   (default: all three)
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
out="${OUT:-$root/build/oom-results}"
mkdir -p "$out"
stages="${*:-tests microbatch finders}"
# Another machine's compiler may warn where this project's CI compiler does
# not: build, and show its warnings, rather than stop at them.
make build CMAKE_FLAGS="-DCMAKE_C_FLAGS=-Wno-error" 2>&1 | grep -E "warning|error" | head -n 20
[ -f build/libgpumem.so ] || exit 1
export GPUMEM_LIBRARY="$root/build/libgpumem.so"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export GPUMEM_CACHE_DIR="${GPUMEM_CACHE_DIR:-$root/build/gpumem-cache}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, accelerate, lightning; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'lightning', lightning.__version__)" | tee -a "$out/gpu.txt"
for stage in $stages; do
  case "$stage" in
    tests)
      (cd tests/gpu/torch && python3 -c "import gpumem.torch as t; print(t.build_graphs_shim())" &&
        python3 -m unittest -v test_torch_gpumem.OutOfMemoryTest test_torch_gpumem.OutOfMemoryFormTest) \
        2>&1 | tee "$out/tests.log" || rc=1
      ;;
    microbatch)
      for a in gpumem native; do
        if [ "$a" = gpumem ]; then launch=(python3 -m gpumem.torch); else launch=(python3); fi
        "${launch[@]}" bench/torch/oom_finders.py microbatch --allocator "$a" --batch "${BATCH:-48}" \
          --cap-gib "${CAP_GIB:-12}" 2>"$out/microbatch-$a.err" | tee -a "$out/oom_finders.jsonl" || rc=1
      done
      ;;
    finders)
      # as many capped processes at once as the GPU's memory holds
      total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
      jobs=${JOBS:-$(python3 -c "print(max(1, min(10, int($total_mib * 0.85 / 1024 / (${CAP_GIB:-12} + 1.5)))))")}
      python3 bench/torch/oom_finders.py all --cap-gib "${CAP_GIB:-12}" --jobs "$jobs" --out "$out" \
        2>"$out/finders.err" | tee "$out/finders.txt" || rc=1
      ;;
    *) echo "oom_gpu.sh: unknown stage '$stage' (tests, microbatch, finders)" >&2; exit 2 ;;
  esac
done
exit $rc
