#!/bin/bash
# Instructions per warm operation of the replay, by callgrind: deterministic,
# so it is the A/B measure of hot-path changes on a noisy machine.
#
#   bash bench/ir_per_op.sh BUILD/gpumem [replay options...]
#
# For each bundled trace: instructions of `replay --passes 3` minus those of
# `replay --passes 1`, over the operations of the two extra warm passes
# (trace parsing and the cold pass cancel out). Needs valgrind.
set -euo pipefail
BIN=${1:?usage: bench/ir_per_op.sh PATH/TO/gpumem [replay options...]}
shift
command -v valgrind >/dev/null || { echo "ir_per_op: valgrind is not installed" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
instructions() {
  valgrind --tool=callgrind --callgrind-out-file=/dev/null "$BIN" replay "$@" 2>&1 >/dev/null |
    awk '/I +refs/ { gsub(",", "", $NF); print $NF }'
}
for trace in "$ROOT"/traces/*.trace.gz; do
  name=$(basename "$trace" .trace.gz)
  ops=$("$BIN" replay --json --passes 0 "$@" "$trace" | python3 -c \
    'import json,sys; print(json.loads(next(l for l in sys.stdin if l.startswith("{")))["ops_cold"])')
  one=$(instructions --passes 1 "$@" "$trace")
  three=$(instructions --passes 3 "$@" "$trace")
  echo "$name warm instructions/op $(((three - one) / 2 / ops))"
done
