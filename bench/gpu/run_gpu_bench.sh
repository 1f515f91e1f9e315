#!/bin/bash
# gpumem on a real GPU, in one command from the repository root:
#
#   bash bench/gpu/run_gpu_bench.sh
#
# 1. builds gpumem (cmake, Release) and runs the GPU tests (ctest -R gpu_);
# 2. runs both GPU test programs under compute-sanitizer memcheck and
#    racecheck and counts their errors (clean: without the checks that make
#    the driver refuse on purpose, which the sanitizer counts as errors;
#    full: memcheck over everything, those refusals counted apart);
# 3. builds the peer harness (bench/gpu/replay_peers.cpp) against the installed
#    PyTorch and this build of gpumem;
# 4. replays every traces/*.trace.gz through gpumem's command line on CUDA
#    (default and pytorch policies, with --min-limit) and through the harness
#    for gpumem (both policies), torch, torch_exp, async and cudamalloc;
# 5. bisects each harness allocator's smallest cap (0.25% of peak live, a few
#    probes at most), the traces in parallel;
# 6. writes the table (trace x allocator) to $OUT/gpu_bench.md and prints it.
#
# Everything is sized to finish in under 9 minutes on one H100; a deadline
# (DEADLINE seconds, default 500) cuts bisections short rather than overrun,
# and the table says so. Knobs (environment): BUILD (build dir, default
# build), PASSES (timed passes per replay, default 5), CM_PASSES (cudamalloc,
# default 2), CLI_PASSES (warm passes for the CLI, default 3), MAX_PROBES
# (bisection probes per allocator, default 10), BISECT_JOBS (traces bisected at
# once, default 4), PEERS, BISECT_PEERS, TRACES (glob), SANITIZE (0 skips
# step 2), TIMEOUT (per replay, default 150 s), GPU_TESTS (ctest -R pattern, default
# gpu_; gpu_test_ leaves out the PyTorch suite, ~4 minutes).
#
# Output files in $OUT (default build-gpu-bench/): gpu_bench.md (the table and
# the machine), gpu_bench.log (every step), results.jsonl (every JSON line),
# tests.log (ctest and sanitizer output).
set -u
ROOT=$(pwd)
if [ ! -f "$ROOT/include/gpumem.h" ]; then
  echo "run from the repository root" >&2
  exit 2
fi
OUT=${OUT:-$ROOT/build-gpu-bench}
BUILD=${BUILD:-build}
WORK=${WORK:-/tmp/gpumem-gpu-bench}
PASSES=${PASSES:-5}
CM_PASSES=${CM_PASSES:-2}
CLI_PASSES=${CLI_PASSES:-3}
MAX_PROBES=${MAX_PROBES:-10}
BISECT_JOBS=${BISECT_JOBS:-4}
PEERS=${PEERS:-"gpumem gpumem_pytorch torch torch_exp async cudamalloc"}
BISECT_PEERS=${BISECT_PEERS:-"gpumem gpumem_pytorch torch torch_exp async"}
TRACES=${TRACES:-traces/*.trace.gz}
SANITIZE=${SANITIZE:-1}
TIMEOUT=${TIMEOUT:-150}
DEADLINE=${DEADLINE:-500}
mkdir -p "$OUT" "$WORK"
rm -f "$WORK"/*.json "$WORK"/*.mincap "$OUT/results.jsonl"
LOG=$OUT/gpu_bench.log
TESTLOG=$OUT/tests.log
: >"$LOG"
: >"$TESTLOG"
START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }
say() { echo "[$(elapsed)s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE - $(elapsed))); }
# Numbers through python3 (always there with PyTorch): floats and JSON.
py() { python3 -c "$@"; }

# ---- the machine --------------------------------------------------------------
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "gpu, driver: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')"
  echo "torch: $(python3 -c 'import torch;print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
  echo "nvcc: $( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | grep -o 'release [0-9.]*' | head -1)"
  echo "host: $(nproc) cores, $(uname -r)"
} >"$WORK/machine.txt"
cat "$WORK/machine.txt" | tee -a "$LOG"

# ---- 1. build and test gpumem ---------------------------------------------------
say "building gpumem in $BUILD"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$WORK/cmake.log" 2>&1
cat "$WORK/cmake.log" >>"$LOG"
CUDA_ENABLED=1
if ! grep -q "CUDA backend enabled" "$WORK/cmake.log"; then
  CUDA_ENABLED=0
  say "WARNING: cmake did not enable the CUDA backend (see gpu_bench.log): GPU tests will skip"
fi
if ! cmake --build "$BUILD" -j "$(nproc)" >>"$LOG" 2>&1; then
  say "BUILD FAILED (see gpu_bench.log)"
  tail -30 "$LOG"
  exit 1
fi

# The peer harness compiles in the background while the tests run.
build_harness() {
  local tdir inc abi cuda std
  tdir=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null)
  inc=$(python3 -c 'import torch.utils.cpp_extension as c;print(" ".join("-I"+p for p in c.include_paths()))' 2>/dev/null)
  abi=$(python3 -c 'import torch;print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>/dev/null || echo 1)
  cuda=${CUDA_HOME:-/usr/local/cuda}
  for std in c++17 c++20; do
    if [ -n "$tdir" ] && g++ -O2 -std=$std -D_GLIBCXX_USE_CXX11_ABI="$abi" -DREPLAY_WITH_TORCH \
      -DREPLAY_WITH_GPUMEM -Iinclude $inc -I"$cuda/include" bench/gpu/replay_peers.cpp \
      "$BUILD/libgpumem.a" -L"$tdir/lib" -lc10 -lc10_cuda -L"$cuda/lib64" -lcudart -ldl -lpthread \
      -lm -Wl,-rpath,"$tdir/lib" -Wl,-rpath,"$cuda/lib64" -o "$WORK/replay_peers" \
      >"$WORK/harness_$std.log" 2>&1; then
      echo "harness: built with PyTorch ($std)"
      return 0
    fi
  done
  # Without PyTorch: gpumem, async and cudamalloc only.
  if g++ -O2 -std=c++17 -DREPLAY_WITH_GPUMEM -Iinclude -I"$cuda/include" bench/gpu/replay_peers.cpp \
    "$BUILD/libgpumem.a" -L"$cuda/lib64" -lcudart -ldl -lpthread -lm -Wl,-rpath,"$cuda/lib64" \
    -o "$WORK/replay_peers" >"$WORK/harness_notorch.log" 2>&1; then
    echo "harness: built WITHOUT PyTorch (torch peers unavailable; see harness_c++17.log)"
    return 0
  fi
  echo "harness: BUILD FAILED"
  return 1
}
rm -f "$WORK/replay_peers"
build_harness >"$WORK/harness.txt" 2>&1 &
HARNESS_PID=$!

GPU_TESTS=${GPU_TESTS:-gpu_}
say "ctest -R $GPU_TESTS"
# -V keeps the tests' own lines (device memory, OOM reports, reuse counts).
(cd "$BUILD" && ctest -R "$GPU_TESTS" -V) >"$WORK/ctest.log" 2>&1
CTEST_RC=$?
cat "$WORK/ctest.log" >>"$TESTLOG"
CTEST_LINE=$(grep -E "tests passed|tests failed" "$WORK/ctest.log" | tail -1)
CTEST_SKIPPED=$(grep -c "\*\*\*Skipped\|(Skipped)" "$WORK/ctest.log")
say "ctest: rc $CTEST_RC: $CTEST_LINE (skipped: $CTEST_SKIPPED)"
grep -E "CHECK failed|passed, [0-9]+ failed|^[0-9]+: SKIP" "$WORK/ctest.log" | head -40 | tee -a "$LOG"

# ---- 2. compute-sanitizer ----------------------------------------------------------
SAN_ROWS=""
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ "$SANITIZE" = 1 ] && [ -n "$CS" ]; then
  # Two modes. clean: GPUMEM_TEST_NO_DRIVER_ERRORS=1 leaves out the checks
  # that make the driver refuse on purpose (out of memory at the device's
  # limit, a map at an unreserved address, a bad free), which the sanitizer
  # reports as API errors; every error it reports then is a real one. full:
  # memcheck over everything, those refusals counted apart.
  for run in "clean memcheck" "clean racecheck" "full memcheck"; do
    mode=${run% *} tool=${run#* }
    for prog in gpu_test_cuda_backend gpu_test_cuda_alloc; do
      log=$WORK/san_${mode}_${tool}_$prog.log
      say "compute-sanitizer --tool $tool $prog ($mode)"
      no_errors=0
      [ "$mode" = clean ] && no_errors=1
      GPUMEM_TEST_NO_DRIVER_ERRORS=$no_errors GPUMEM_TEST_MEMINFO_TOL_MIB=1024 GPUMEM_TEST_QUICK=1 \
        timeout 240 "$CS" --tool "$tool" --print-limit 50 "$BUILD/tests/$prog" >"$log" 2>&1
      rc=$?
      { echo "== compute-sanitizer --tool $tool $prog, $mode (rc $rc)"; cat "$log"; } >>"$TESTLOG"
      # memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H
      # hazards displayed (E errors, W warnings)".
      total=$(grep -o "ERROR SUMMARY: [0-9]*" "$log" | grep -o "[0-9]*$" | tail -1)
      [ -n "$total" ] || total=$(grep -o "RACECHECK SUMMARY: .*(\([0-9]*\) errors" "$log" |
        grep -o "([0-9]*" | tr -d "(" | tail -1)
      api=$(grep -c "Program hit" "$log")
      hazards=$(grep -o "RACECHECK SUMMARY: [0-9]* hazard" "$log" | grep -o "[0-9]*" | head -1)
      result=$(grep -E "passed, [0-9]+ failed|^SKIP" "$log" | tail -1)
      SAN_ROWS="$SAN_ROWS| $tool ($mode) | $prog | ${total:-?} | $api | ${hazards:--} | $rc | $result |
"
      say "  errors ${total:-?} (API errors reported: $api), hazards ${hazards:--}, exit $rc: $result"
    done
  done
else
  say "compute-sanitizer skipped (SANITIZE=$SANITIZE, found: ${CS:-no})"
fi

# ---- 3. the harness ----------------------------------------------------------------
wait $HARNESS_PID
cat "$WORK/harness.txt" | tee -a "$LOG"
cat "$WORK"/harness_*.log >>"$LOG" 2>/dev/null
RP=$WORK/replay_peers
[ -x "$RP" ] || RP=""

# ---- 4. replays ---------------------------------------------------------------------
NAMES=""
for gz in $TRACES; do
  name=$(basename "$gz" .trace.gz)
  NAMES="$NAMES $name"
  zcat "$gz" >"$WORK/$name.trace"
done
live_of() { # peak live bytes of a trace, read by the harness or awk
  if [ -n "$RP" ]; then
    "$RP" --parse-only "$WORK/$1.trace" | py 'import json,sys;print(json.load(sys.stdin)["peak_live_bytes"])'
  else
    awk '$1=="a"{s[$2]=$3;c+=$3;if(c>m)m=c} $1=="f"{c-=s[$2]} END{printf "%d\n", m}' "$WORK/$1.trace"
  fi
}
for name in $NAMES; do
  echo "$(live_of "$name")" >"$WORK/$name.live"
done

GPUMEM_BIN=$BUILD/gpumem
for name in $NAMES; do
  for pol in default pytorch; do
    say "gpumem replay --device cuda --policy $pol --min-limit $name"
    out=$WORK/cli_${name}_$pol.json
    timeout "$TIMEOUT" "$GPUMEM_BIN" replay --device cuda --json --min-limit --policy "$pol" \
      --passes "$CLI_PASSES" "$WORK/$name.trace" >"$out" 2>"$WORK/cli_${name}_$pol.err"
    rc=$?
    [ $rc = 0 ] || say "  failed (rc $rc): $(tail -c 300 "$WORK/cli_${name}_$pol.err")"
    grep '^{' "$out" | tail -1 >>"$OUT/results.jsonl"
  done
done

if [ -n "$RP" ]; then
  for name in $NAMES; do
    for peer in $PEERS; do
      p=$PASSES
      [ "$peer" = cudamalloc ] && p=$CM_PASSES
      say "replay_peers $name $peer (passes $p)"
      out=$WORK/peer_${name}_$peer.json
      timeout "$TIMEOUT" "$RP" --passes "$p" "$WORK/$name.trace" "$peer" >"$out" \
        2>"$WORK/peer_${name}_$peer.err"
      rc=$?
      [ $rc = 0 ] || say "  failed (rc $rc): $(tail -c 300 "$WORK/peer_${name}_$peer.err")"
      grep '^{' "$out" | tail -1 >>"$OUT/results.jsonl"
    done
  done
fi

# ---- 5. smallest cap, by bisection ---------------------------------------------------
# Between peak live (no allocator fits below it) and the allocator's own
# unconstrained peak reserved (plus 2 MiB; 1.6 x peak live when that fails),
# until the interval is under 0.25% of peak live or MAX_PROBES probes ran or
# the deadline came. Writes "min_cap_bytes probes resolution_ratio" or "fail".
bisect_one() { # name peer
  local name=$1 peer=$2 live lo hi mid probes=0 res
  live=$(cat "$WORK/$name.live")
  lo=$live
  hi=$(py "import json;d=json.load(open('$WORK/peer_${name}_$peer.json'));print(int(d['peak_reserved_bytes'])+(2<<20))" 2>/dev/null)
  [ -n "$hi" ] || hi=$(py "print(int($live*1.6))")
  probe() { timeout "$TIMEOUT" "$RP" --cap "$1" "$WORK/$name.trace" "$peer" >/dev/null 2>&1; }
  if ! probe "$hi"; then
    probes=$((probes + 1))
    hi=$(py "print(int($live*1.6))")
    if ! probe "$hi"; then
      echo "fail $((probes + 1)) -" >"$WORK/${name}_$peer.mincap"
      return
    fi
  fi
  probes=$((probes + 1))
  local step
  step=$(py "print(int($live*0.0025))")
  while [ $((hi - lo)) -gt "$step" ] && [ $probes -lt "$MAX_PROBES" ] && [ "$(left)" -gt 20 ]; do
    mid=$(((lo + hi) / 2))
    if probe "$mid"; then hi=$mid; else lo=$mid; fi
    probes=$((probes + 1))
  done
  res=$(py "print('%.4f' % (($hi-$lo)/$live))")
  echo "$hi $probes $res" >"$WORK/${name}_$peer.mincap"
}
bisect_trace() { # name
  for peer in $BISECT_PEERS; do
    [ -f "$WORK/peer_${1}_$peer.json" ] && grep -q '^{' "$WORK/peer_${1}_$peer.json" || continue
    bisect_one "$1" "$peer"
  done
}
if [ -n "$RP" ]; then
  say "bisecting min caps ($BISECT_JOBS traces at once, at most $MAX_PROBES probes each)"
  running=0
  for name in $NAMES; do
    bisect_trace "$name" &
    running=$((running + 1))
    if [ $running -ge "$BISECT_JOBS" ]; then
      wait -n
      running=$((running - 1))
    fi
  done
  wait
fi

# ---- 6. the table ----------------------------------------------------------------------
say "writing $OUT/gpu_bench.md"
export WORK OUT NAMES PEERS DEADLINE
export CTEST_LINE CTEST_RC CTEST_SKIPPED CUDA_ENABLED GPU_TESTS
export SAN_ROWS
export ELAPSED=$(elapsed)
python3 - <<'EOF'
import json, os
work, out = os.environ["WORK"], os.environ["OUT"]
names = os.environ["NAMES"].split()
peers = os.environ["PEERS"].split()

def load(path):
    try:
        lines = [l for l in open(path) if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None

def mincap(name, peer):
    try:
        f = open(os.path.join(work, f"{name}_{peer}.mincap")).read().split()
    except OSError:
        return None
    return f

def fmt(x, spec):
    return "-" if x is None else format(x, spec)

rows = []
for name in names:
    live = int(open(os.path.join(work, f"{name}.live")).read())
    for pol in ("default", "pytorch"):
        d = load(os.path.join(work, f"cli_{name}_{pol}.json"))
        label = f"gpumem {pol} (CLI)"
        if not d:
            rows.append((name, live, label, None, None, None, None, None, "failed"))
            continue
        rows.append((name, live, label, d.get("reserved_ratio"),
                     (d["device_used_peak_bytes"] / live) if d.get("device_used_peak_bytes") else None,
                     d.get("min_limit_ratio"), d.get("ns_per_op_cold"), d.get("ns_per_op_warm"),
                     "oom" if d.get("oom") else ""))
    for peer in peers:
        d = load(os.path.join(work, f"peer_{name}_{peer}.json"))
        label = {"gpumem": "gpumem default (harness)",
                 "gpumem_pytorch": "gpumem pytorch (harness)"}.get(peer, peer)
        if not d:
            rows.append((name, live, label, None, None, None, None, None, "failed"))
            continue
        mc = mincap(name, peer)
        note = ""
        cap_ratio = None
        if mc and mc[0] == "fail":
            note = "no cap <= 1.6x fits"
        elif mc:
            cap_ratio = int(mc[0]) / live
            if float(mc[2]) > 0.0025:
                note = f"cap within {float(mc[2]) * 100:.2f}% ({mc[1]} probes)"
        rows.append((name, live, label, d.get("reserved_ratio"), d.get("device_used_ratio"),
                     cap_ratio, d.get("ns_per_op_cold"), d.get("ns_per_op_warm"), note))

machine = open(os.path.join(work, "machine.txt")).read().strip()
md = ["# gpumem on the GPU", "", "```", machine, "```", ""]
md += [f"GPU tests (ctest -R {os.environ['GPU_TESTS']}): rc {os.environ['CTEST_RC']}: {os.environ['CTEST_LINE']} "
       f"(skipped: {os.environ['CTEST_SKIPPED']}); CUDA backend built: "
       f"{'yes' if os.environ['CUDA_ENABLED'] == '1' else 'NO'}", ""]
san = os.environ.get("SAN_ROWS", "").strip()
if san:
    md += ["| sanitizer (mode) | program | errors (total) | API errors among them (full mode: provoked on purpose) | racecheck hazards | exit | result |",
           "|---|---|---|---|---|---|---|", san, ""]
md += ["Ratios are over the trace's peak live bytes. reserved: the allocator's own peak "
       "(first, cold pass). device-seen: largest drop of cudaMemGetInfo's free memory below "
       "the baseline, sampled whenever reserved grew (an untimed pass after emptying the "
       "cache). min cap: smallest hard cap under which the whole trace replays (bisection; "
       "torch via set_per_process_memory_fraction, async via the pool's maxSize, gpumem via "
       "its limit; cudamalloc not bisected). ns/op: host time per allocation or free; warm "
       "is the median of passes 2..N. Streams of the trace are real CUDA streams.", ""]
md += ["| trace | peak live | allocator | reserved | device-seen | min cap | cold ns/op | warm ns/op | note |",
       "|---|---|---|---|---|---|---|---|---|"]
for (name, live, label, rr, dr, cr, cold, warm, note) in rows:
    md.append(f"| {name} | {live / 2**30:.3f} GiB | {label} | {fmt(rr, '.4f')} | {fmt(dr, '.4f')} | "
              f"{fmt(cr, '.4f')} | {fmt(cold, '.0f')} | {fmt(warm, '.0f')} | {note} |")
md += ["", f"Run time: {os.environ['ELAPSED']} s."]
text = "\n".join(md) + "\n"
open(os.path.join(out, "gpu_bench.md"), "w").write(text)
print(text)
EOF
say "done in $(elapsed) s"
