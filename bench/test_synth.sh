#!/bin/bash
# Tests of the synthetic workload generators (bench/bench_synth.c): the same
# seed writes the same traces, another seed other ones; every trace replays
# on the simulated device without running out of memory; the fine-tuning
# and serving traces have the size and shape they are described with.
# usage: bash bench/test_synth.sh BENCH_SYNTH GPUMEM_BIN
set -u
SYNTH=$1
BIN=$2
FAIL=0
T=$(mktemp -d "${TMPDIR:-/tmp}/gpumem_synth.XXXXXX")
trap 'rm -rf "$T"' EXIT
bad() {
  FAIL=$((FAIL + 1))
  echo "FAIL: $*" >&2
}
NAMES="synth_varlen synth_kvcache synth_random synth_streams synth_finetune synth_serve"

mkdir -p "$T/a" "$T/b" "$T/c"
"$SYNTH" "$T/a" 42 >/dev/null || bad "bench_synth $T/a 42 failed"
"$SYNTH" "$T/b" 42 >/dev/null || bad "bench_synth $T/b 42 failed"
"$SYNTH" "$T/c" 7 >/dev/null || bad "bench_synth $T/c 7 failed"
for n in $NAMES; do
  [ -s "$T/a/$n.trace" ] || bad "$n.trace not written"
  cmp -s "$T/a/$n.trace" "$T/b/$n.trace" || bad "$n: the same seed wrote different traces"
done
for n in synth_finetune synth_serve; do
  cmp -s "$T/a/$n.trace" "$T/c/$n.trace" && bad "$n: seeds 42 and 7 wrote the same trace"
done

# json_field NAME: the number after "NAME": in $out
json_field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" <<<"$out"; }

for n in $NAMES; do
  out=$("$BIN" replay --json --passes 1 "$T/a/$n.trace" 2>&1) || bad "$n does not replay: $out"
  grep -q '"oom":false' <<<"$out" || bad "$n ran out of memory without a limit: $out"
done

GIB=1073741824
out=$("$BIN" replay --json --passes 0 "$T/a/synth_finetune.trace")
live=$(json_field peak_live_bytes)
allocs=$(json_field allocations)
# 40 optimizer steps of 2 micro-steps, each ~780 allocations
[ "$allocs" -gt 50000 ] || bad "synth_finetune: $allocs allocations, want > 50000"
[ "$live" -ge $((10 * GIB)) ] && [ "$live" -le $((20 * GIB)) ] ||
  bad "synth_finetune: peak live $live bytes, want 10-20 GiB"
# what stays live at the end: the 146 weights and AdamW's two moments of
# each (made at the first step); gradients go every step (set_to_none)
left=$(($(grep -c '^a ' "$T/a/synth_finetune.trace") - $(grep -c '^f ' "$T/a/synth_finetune.trace")))
[ "$left" -eq $((3 * 146)) ] || bad "synth_finetune: $left allocations left live at the end, want 438"
# shapes drawn per micro-step: many distinct sizes (80 micro-steps)
sizes=$(awk '$1 == "a" { print $3 }' "$T/a/synth_finetune.trace" | sort -u | wc -l)
[ "$sizes" -gt 500 ] || bad "synth_finetune: $sizes distinct sizes, want > 500 (shapes drawn per micro-step)"

out=$("$BIN" replay --json --passes 0 "$T/a/synth_serve.trace")
allocs=$(json_field allocations)
[ "$allocs" -gt 100000 ] || bad "synth_serve: $allocs allocations, want > 100000"
# every request frees what it made: only the weights (12 layers x 7 + 2) stay
left=$(($(grep -c '^a ' "$T/a/synth_serve.trace") - $(grep -c '^f ' "$T/a/synth_serve.trace")))
[ "$left" -eq 86 ] || bad "synth_serve: $left allocations left live at the end, want the 86 weights"
# the caches grow by concatenation: per decoded token and layer, a key and
# a value tensor one token longer are made, each followed at once by the
# free of the one it replaces (at least 200 requests x 8 tokens x 12
# layers x 2)
grows=$(awk '$1 == "a" { size[$2] = $3; last = $3; next }
             $1 == "f" && last > size[$2] { n++ } { last = 0 } END { print n + 0 }' "$T/a/synth_serve.trace")
[ "$grows" -gt 38400 ] || bad "synth_serve: $grows frees right after a larger allocation, want > 38400"

if [ "$FAIL" -ne 0 ]; then
  echo "test_synth: $FAIL failures" >&2
  exit 1
fi
echo "test_synth: ok"
