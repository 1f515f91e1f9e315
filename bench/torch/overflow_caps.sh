#!/usr/bin/env bash
# The overflow tier against its alternatives under caps below a job's own
# peak (issue 62's "done when"): a Llama-style fine-tune (bench/torch/
# overflow_job.py: bf16 autocast, AdamW, deterministic algorithms) runs
# uncapped under gpumem, then with gpumem's limit at its peak reserved / 1.10,
# / 1.25 and / 1.5 three ways: overflow:host, gpumem.torch.microbatch at the
# same effective batch, and FSDP2 with CPUOffloadPolicy on one GPU. Losses
# are compared bit for bit with the uncapped run's, step time against it.
#
#     bash bench/torch/overflow_caps.sh OUT [BUILD] [STEPS]
#
# OUT: a directory for one JSON file per run and table.txt (also printed);
# BUILD: gpumem's build directory (default build); STEPS: steps a run (50).
# CAPS (default "1.10 1.25 1.5") and WAYS (default "overflow microbatch
# fsdp") pick a subset; OPTIMIZER (foreach, the default, or fused) picks
# AdamW's implementation outside FSDP2 (whose optimizer runs on the CPU). Runs one at a time on GPU 0; each run at most
# RUN_TIMEOUT seconds (110),
# and no run starts after BUDGET seconds (420), so that the whole fits in
# nine minutes; a run not made is a row that says so. The FSDP2 runs take
# 10 steps (their optimizer steps on the CPU take seconds each); the table
# says so.
set -u
out="${1:?usage: overflow_caps.sh OUT [BUILD] [STEPS]}"
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${2:-}"
steps="${3:-50}"
need_library overflow_caps
mkdir -p "$out" || exit 1
run_timeout="${RUN_TIMEOUT:-110}"
budget="${BUDGET:-420}"
start=$SECONDS
job="$root/bench/torch/overflow_job.py"

run() { # name mode cap
  local name="$1" mode="$2" cap="$3"
  if ((SECONDS - start > budget)); then
    echo "{\"mode\": \"$mode\", \"cap\": $cap, \"error\": \"not run: the time budget of ${budget} s was spent\"}" >"$out/$name.json"
    return
  fi
  echo "== $name ($mode, cap $cap), $((SECONDS - start)) s in" >&2
  timeout -k 10 "$run_timeout" "$py" "$job" --mode "$mode" --cap "$cap" --steps "$steps" \
    --optimizer "${OPTIMIZER:-foreach}" \
    --out "$out/$name.json" >"$out/$name.log" 2>&1
  local rc=$?
  if [ ! -s "$out/$name.json" ]; then
    echo "{\"mode\": \"$mode\", \"cap\": $cap, \"error\": \"exit status $rc (timeout: 124), no result; see $name.log\"}" >"$out/$name.json"
  fi
  tail -n 1 "$out/$name.log" >&2
}

run uncapped uncapped 0
peak=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("peak_reserved") or 0)' "$out/uncapped.json")
if [ "$peak" -le 0 ]; then
  echo "overflow_caps: the uncapped run gave no peak; see $out/uncapped.log" >&2
  cat "$out/uncapped.log" >&2
  exit 1
fi
# (caps outermost: a budget spent before the end leaves whole caps unrun,
# not a mode unrun at every cap)
for div in ${CAPS:-1.10 1.25 1.5}; do
  cap=$("$py" -c "print(int($peak / $div))")
  for mode in ${WAYS:-overflow microbatch fsdp}; do
    run "${mode}_${div}" "$mode" "$cap"
  done
done
"$py" "$root/bench/torch/overflow_report.py" "$out" | tee "$out/table.txt"
