#!/usr/bin/env bash
# Greedy generate() with transformers' dynamic KV cache, GPT-2 of three
# sizes, several batches, prompt and generation lengths, dtypes and ways of
# loading the weights (bench/torch/userjobs/greedy_decode.py), each recorded
# at two batch sizes by gpumem's recorder on fake CUDA tensors (no GPU
# needed; the H200's device profile): the traces of traces/decode/.
#
#   bash bench/torch/record_decode.sh OUTDIR
#
# OUTDIR gets NAME.trace.gz per recording, NAME naming the model, dtype
# (_dev: built in fp32 on the device and converted there), batch, prompt
# and new tokens. About 10 minutes on two cores.
set -eu
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out=${1:?usage: record_decode.sh OUTDIR}
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/record_decode.XXXXXX")
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
record() { # stem batches model dtype load prompt new_tokens
  local stem=$1 batches=$2 model=$3 dtype=$4 load=$5 prompt=$6 new=$7
  python3 -m gpumem.predict --memory 80G --cpu --profile h200-torch2.11 --no-confirm --batch-sizes "$batches" \
    --traces "$work/$stem" "$root/bench/torch/userjobs/greedy_decode.py" --batch-size '{B}' \
    --model "$model" --dtype "$dtype" --load "$load" --prompt "$prompt" --new-tokens "$new" >"$work/$stem.log" 2>&1 ||
    { cat "$work/$stem.log" >&2; exit 1; }
  local short=${model/gpt2-medium/gpt2m}; short=${short/gpt2-large/gpt2l}
  local tag=$dtype; [ "$load" = device ] && tag=${dtype}_dev
  for b in ${batches//,/ }; do
    gzip -9 -c "$work/$stem/b$b/trace" >"$out/${short}_${tag}_b${b}_p${prompt}_n${new}.trace.gz"
  done
}
record a 1,8 gpt2 bf16 host 32 64
record b 4,16 gpt2 bf16 host 32 64
record c 1,8 gpt2 fp32 host 32 64
record d 2,8 gpt2 bf16 host 128 128
record e 1,8 gpt2 fp32 device 32 64
record f 2,8 gpt2 bf16 device 32 64
record g 1,8 gpt2-medium bf16 host 32 64
record h 1,4 gpt2-large bf16 host 32 32
record i 2,4 gpt2-medium fp16 host 64 128
record j 1,8 gpt2-large bf16 device 32 64
record k 1,16 gpt2 bf16 host 16 200
ls "$out"
