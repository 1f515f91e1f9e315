#!/usr/bin/env bash
# CUDA graphs, reduce-overhead, cuDNN benchmark, MemPool, snapshots and IPC
# under gpumem, against native PyTorch; then the lockstep step-time and
# memory comparison of torch.compile(mode="reduce-overhead").
#
#   bash tests/gpu/torch/run_graphs.sh [BUILD_DIR]     (default: build)
#
# Writes its log to $OUT/graphs.log (or ./graphs.log). Prints, in order:
# the compile check of gpumem's full PyTorch allocator (its compiler error,
# if any, comes first), one "PASS name" / "FAIL name" / "SKIP name" line
# per item, and "BENCH mode ... ratio R (PASS|FAIL)" for each benchmark.
# GRAPHS_TESTS picks tests (names of test_graphs.GraphsTest); GRAPHS_BENCH=0
# skips the benchmarks.
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
build="${1:-build}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
out="${OUT:-$root}"
mkdir -p "$out"
log="$out/graphs.log"
py="${PYTHON:-python3}"
cd "$root"
if [ ! -f "$build/libgpumem.so" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build "$build" -j8 --target gpumem_shared >/dev/null 2>&1 || cmake --build "$build" -j8 >/dev/null
fi
export GPUMEM_LIBRARY="$build/libgpumem.so"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export GPUMEM_CACHE_DIR="${GPUMEM_CACHE_DIR:-$build/gpumem-cache}"
{
  echo "== compile check: gpumem's full PyTorch allocator"
  "$py" - <<'PY'
import time, gpumem.torch as t
t0 = time.time()
path, why = t.build_graphs_shim()
if path:
    print("PASS compile (%.1f s): %s" % (time.time() - t0, path))
else:
    print("FAIL compile: the full allocator did not build; graphs fall back to a clear error.\n%s" % why)
PY
  echo "== tests (native vs gpumem, fresh processes; one process per test)"
  tests="${GRAPHS_TESTS:-test_cuda_graph test_make_graphed_callables test_reduce_overhead_inference test_reduce_overhead_training test_cudnn_benchmark test_mempool test_mempool_no_split test_mempool_use_on_oom test_mempool_allocator test_snapshot test_ipc}"
  for t in $tests; do
    t0=$(date +%s)
    if (cd "$root/tests/gpu/torch" && timeout "${TEST_TIMEOUT:-240}" "$py" -m unittest "test_graphs.GraphsTest.$t") >"$out/$t.log" 2>&1; then
      echo "PASS $t ($(( $(date +%s) - t0 )) s)"
    else
      echo "FAIL $t ($(( $(date +%s) - t0 )) s; exit $?)"
      tail -c 4000 "$out/$t.log"
    fi
  done
  [ "${GRAPHS_BENCH:-1}" = 0 ] && exit 0  # (tests only)
  echo "== lockstep: torch.compile(mode='reduce-overhead'), native vs gpumem"
  for mode in train infer; do
    r=$(timeout 240 "$py" bench/torch/graphs_ab.py --mode "$mode" --steps "${GRAPHS_STEPS:-200}" --warmup 20 | tail -1)
    echo "$r"
    "$py" -c "
import json,sys
r=json.loads(sys.argv[1]); ok=r['ratio']<=1.01 and r['peak_reserved']['gpumem']<=r['peak_reserved']['native']
lo, hi = r['ratio_ci95']
print('BENCH %s median native %.3f ms gpumem %.3f ms ratio %.4f [%.4f, %.4f] geo mean %.4f peak reserved native %d gpumem %d (%s)' % (r['mode'], r['median_ms']['native'], r['median_ms']['gpumem'], r['ratio'], lo, hi, r['geo_mean_step_ratio'], r['peak_reserved']['native'], r['peak_reserved']['gpumem'], 'PASS' if ok else 'FAIL'))
" "$r" || echo "BENCH $mode FAIL (no result)"
  done
} 2>&1 | tee "$log"
