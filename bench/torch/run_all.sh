#!/usr/bin/env bash
# End-to-end comparison on a GPU: each workload of bench/torch/workloads.py
# under each allocator, every pair in its own process, then (same process,
# after the timed run) a bisection over set_per_process_memory_fraction for
# the smallest cap under which it still trains. Writes a markdown table to
# $OUT/torch_bench.md when OUT is set, else to stdout; raw JSON lines go to
# torch_bench.jsonl beside it (or to stderr).
#
#   bash bench/torch/run_all.sh [BUILD_DIR]          (default: build)
#
# Knobs (environment), defaults sized for about 8 minutes on an H100:
#   WORKLOADS   "gpt2_train resnet50_train llama_ckpt_train t5_varlen_prefetch"
#   ALLOCATORS  "native expandable gpumem"
#   STEPS=6 WARMUP=2   timed steps and warm-up steps per run
#   PROBES=3           bisection probes per pair (0: none)
#   GPUMEM_CONF        configuration of the gpumem runs
#   RUN_TIMEOUT=240    seconds per process
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
WORKLOADS="${WORKLOADS:-gpt2_train resnet50_train llama_ckpt_train t5_varlen_prefetch}"
ALLOCATORS="${ALLOCATORS:-native expandable gpumem}"
STEPS="${STEPS:-6}"
WARMUP="${WARMUP:-2}"
PROBES="${PROBES:-3}"
RUN_TIMEOUT="${RUN_TIMEOUT:-240}"

case " $ALLOCATORS " in
  *" gpumem "*) need_library run_all ;;
esac

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  md="$OUT/torch_bench.md"
  jsonl="$OUT/torch_bench.jsonl"
else
  md=/dev/stdout
  jsonl="$(mktemp)"
  trap 'rm -f "$jsonl"' EXIT
fi
: >"$jsonl"

start=$(date +%s)
for w in $WORKLOADS; do
  for a in $ALLOCATORS; do
    t0=$(date +%s)
    timeout "$RUN_TIMEOUT" "$py" "$root/bench/torch/workloads.py" "$w" --allocator "$a" \
      --steps "$STEPS" --warmup "$WARMUP" --bisect "$PROBES" >"$jsonl.out" 2>"$jsonl.err"
    rc=$?
    line=$(grep '^{' "$jsonl.out" | tail -1)
    if [ -z "$line" ]; then
      why=$(tail -3 "$jsonl.err" | tr '\n' ' ' | tr -d '"\\' | cut -c1-300)
      line="{\"workload\": \"$w\", \"allocator\": \"$a\", \"error\": \"exit $rc: $why\"}"
    fi
    echo "$line" >>"$jsonl"
    echo "run_all: $w / $a: $(( $(date +%s) - t0 )) s" >&2
  done
done
rm -f "$jsonl.err" "$jsonl.out"
echo "run_all: total $(( $(date +%s) - start )) s" >&2

"$py" - "$jsonl" >"$md" <<'PY'
import json
import sys

GIB = 2**30
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
dev = next((r.get("device") for r in rows if r.get("device")), "unknown GPU")
print("# PyTorch workloads under each allocator\n")
print("Device: %s. Median step time after warm-up (GPU synchronized around each step); "
      "peaks from torch.cuda.max_memory_reserved/allocated (gpumem's own figures when it is the "
      "allocator); min cap: smallest per-process memory fraction (bisection) under which the same "
      "steps still train, and its ratio to the peak allocated bytes.\n" % dev)
print("| workload | allocator | step ms | peak reserved | peak allocated | reserved / allocated "
      "| min cap | min cap / allocated | OOM |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if "error" in r:
        print("| %s | %s | error: %s |  |  |  |  |  |  |" % (r["workload"], r["allocator"], r["error"]))
        continue
    res, alloc = r.get("peak_reserved") or 0, r.get("peak_allocated") or 0
    cap = r.get("min_cap_bytes")
    print("| %s | %s | %s | %.2f GiB | %.2f GiB | %s | %s | %s | %s |" % (
        r["workload"], r["allocator"],
        "%.1f" % r["median_ms"] if r.get("median_ms") is not None else "-",
        res / GIB, alloc / GIB,
        "%.3f" % (res / alloc) if alloc else "-",
        "%.2f GiB (%.4f)" % (cap / GIB, r["min_fraction"]) if cap else "-",
        "%.3f" % (cap / alloc) if cap and alloc else "-",
        "yes" if r.get("oom") else "no"))
notes = [r for r in rows if r.get("gpumem")]
if notes:
    print("\ngpumem's device calls and synchronizations over the whole timed run (%s allocations):\n"
          % ", ".join("%s %s" % (r["workload"], r["gpumem"].get("allocation.all.allocated")) for r in notes))
    for r in notes:
        g = r["gpumem"]
        print("- %s: %s" % (r["workload"], ", ".join("%s %s" % (k.replace("backend_calls.", ""), v)
                                                     for k, v in g.items() if k != "allocation.all.allocated")))
PY
if [ -n "${OUT:-}" ]; then cat "$md"; fi
