#!/usr/bin/env bash
# Step time of native PyTorch against gpumem, in pairs run at the same time
# on two GPUs of one host: each round starts one native and one gpumem
# process together (each its own process, bench/torch/workloads.py), and the
# two swap GPUs every round so that a difference between the GPUs cancels.
# Runs that overlap in time share the host's slow and fast spells, which on
# these shared machines move a run's median step time by more than the 1%
# being looked for; pairing takes that out of the comparison.
#
#   bash bench/torch/paired_ab.sh [BUILD_DIR]          (default: build)
#
# Needs two GPUs. Knobs (environment):
#   WORKLOADS   "gpt2_train" (space-separated; each round runs each once)
#   DEADLINE=300  seconds; no round starts that would end after it
#   ROUND_S=40    a round's expected length, for the deadline
#   STEPS=12 WARMUP=6   timed and warm-up steps per run
#   SPLIT_CPUS=0  1 pins each process to its own half of the host's cores
#                 (host-bound workloads otherwise contend for them)
#   OUT           directory for paired_ab.jsonl (default: the build dir)
# Prints a line per pair and, per workload, the medians of the run medians,
# their ratio with a bootstrap 95% interval, and how many pairs gpumem lost.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
WORKLOADS="${WORKLOADS:-gpt2_train}"
DEADLINE="${DEADLINE:-300}"
ROUND_S="${ROUND_S:-40}"
STEPS="${STEPS:-12}"
WARMUP="${WARMUP:-6}"
out="${OUT:-$build}"
mkdir -p "$out"
log="$out/paired_ab.jsonl"
: >"$log"
need_library paired_ab
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "paired_ab: needs two GPUs, found ${gpus:-0}" >&2
  exit 77
fi
half=$(($(nproc) / 2))
pin() { # GPU index -> the taskset prefix for its half of the cores, or nothing
  [ "${SPLIT_CPUS:-0}" = 1 ] && echo "taskset -c $(($1 * half))-$(($1 * half + half - 1))"
}
run() { # GPU allocator workload -> one JSON line on stdout
  CUDA_VISIBLE_DEVICES=$1 $(pin "$1") timeout 300 "$py" "$root/bench/torch/workloads.py" "$3" \
    --allocator "$2" --steps "$STEPS" --warmup "$WARMUP" 2>>"$out/paired_ab.$2.stderr" |
    grep '^{' | tail -1
}
start=$(date +%s)
round=0
while [ $(($(date +%s) - start + ROUND_S)) -lt "$DEADLINE" ]; do
  round=$((round + 1))
  native_gpu=$(((round + 1) % 2))
  gpumem_gpu=$((round % 2))
  for w in $WORKLOADS; do
    [ $(($(date +%s) - start + ROUND_S)) -lt "$DEADLINE" ] || break
    run "$native_gpu" native "$w" >"$out/paired_ab.native.json" &
    a=$!
    run "$gpumem_gpu" gpumem "$w" >"$out/paired_ab.gpumem.json" &
    b=$!
    wait "$a" "$b"
    echo "$w $round native $native_gpu $(cat "$out/paired_ab.native.json")" >>"$log"
    echo "$w $round gpumem $gpumem_gpu $(cat "$out/paired_ab.gpumem.json")" >>"$log"
    tail -2 "$log" | "$py" -c '
import json, sys
rows = [l.split(" ", 4) for l in sys.stdin]
try:
    r = {a: (g, json.loads(j)) for _, _, a, g, j in rows}
    n, m = r["native"][1], r["gpumem"][1]
    print("%s round %s: native (GPU %s) %.3f ms, gpumem (GPU %s) %.3f ms, ratio %.4f; gpumem counters over the timed steps: %s"
          % (rows[0][0], rows[0][1], r["native"][0], n["median_ms"], r["gpumem"][0], m["median_ms"],
             m["median_ms"] / n["median_ms"], m.get("gpumem_timed")))
except Exception as e:
    print("%s round %s: a run failed (%s); see %s" % (rows[0][0], rows[0][1], e, "paired_ab.*.stderr"))
'
  done
done
"$py" - "$log" <<'PY'
import json, random, statistics as st, sys

pairs = {}
for line in open(sys.argv[1]):
    w, rnd, alloc, _gpu, js = line.split(" ", 4)
    try:
        pairs.setdefault(w, {}).setdefault(rnd, {})[alloc] = json.loads(js)["median_ms"]
    except (ValueError, KeyError):
        pass
for w, rounds in pairs.items():
    both = [r for r in rounds.values() if r.get("native") and r.get("gpumem")]
    if not both:
        print("%s: no complete pair" % w)
        continue
    nat = [r["native"] for r in both]
    gm = [r["gpumem"] for r in both]
    rng = random.Random(1)
    boot = []
    for _ in range(10000):
        idx = [rng.randrange(len(both)) for _ in both]
        boot.append(st.median([gm[i] for i in idx]) / st.median([nat[i] for i in idx]))
    boot.sort()
    print("%s: %d pairs; median of run medians native %.3f ms, gpumem %.3f ms, ratio %.4f "
          "(bootstrap 95%%: %.4f-%.4f); gpumem slower in %d of %d pairs"
          % (w, len(both), st.median(nat), st.median(gm), st.median(gm) / st.median(nat),
             boot[250], boot[9750], sum(g > n for g, n in zip(gm, nat)), len(both)))
PY
