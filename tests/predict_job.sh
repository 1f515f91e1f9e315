#!/bin/bash
# A small training job's allocations at batch size B, as gpumem's recorder
# would write them: the input of tests/predict_test.sh and of the example
# in docs/predict.md. Each step allocates two activations affine in the
# batch, attention scores quadratic in it (B x B), a constant workspace
# and a gradient freed one step later; one activation is used on a side
# stream whose handle differs from run to run, as in real recordings.
# With LENGTH set, the job is one over sequences of that many tokens: the
# activations grow with B x LENGTH, the scores with B x LENGTH^2, and a
# mask with LENGTH^2 alone.
# usage: [LENGTH=L] bash tests/predict_job.sh B [STEPS [shrink]]
#   shrink: also one allocation of 100*B - 150 bytes a step (none below B = 2)
set -eu
b=$1
steps=${2:-3}
shrink=${3:-}
mib=1048576
length=${LENGTH:-}
echo "# gpumem-trace v1"
echo "a 0 $((64 * mib)) 0"
echo "a 1 4096 0"
for s in $(seq 1 "$steps"); do
  if [ -n "$length" ]; then
    echo "a 10 $((8192 * b * length + 512)) 0"
    echo "a 11 $((4096 * b * length)) 0"
    echo "a 12 $((16 * b * length * length + 2 * length * length + 1024 * b)) 0"
  else
    echo "a 10 $((mib * b + 512)) 0"
    echo "a 11 $((mib / 2 * b)) 0"
    echo "a 12 $((4096 * b * b + 1024 * b)) 0"
  fi
  echo "a 13 $((8 * mib)) 0"
  echo "r 11 $(printf '0x%x' $((0x7f00 + b)))"
  echo "f 13"
  if [ -n "$shrink" ]; then
    echo "a 14 $((100 * b - 150)) 0"
    echo "f 14"
  fi
  if [ "$s" -gt 1 ]; then echo "f 20"; fi
  echo "a 20 $((2 * mib + 256 * b)) 0"
  echo "f 12"
  echo "f 11"
  echo "f 10"
  echo "# step $s"
done
