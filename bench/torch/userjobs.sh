#!/usr/bin/env bash
# Jobs as users run them (a fine-tuning loop whose batch shapes change every
# micro-step, a generate() server), gpumem against native PyTorch and, under
# limits of 1.02 and 1.01 x the job's peak allocated bytes, against
# expandable segments and against gpumem unlimited; all trained in turns on
# one GPU (bench/torch/userjobs.py says what is compared and what passes).
#
#   bash bench/torch/userjobs.sh [BUILD_DIR]          (default: build)
#
# About 6-8 minutes on one H200 with the defaults. Knobs (environment):
# WORKLOADS, LIMIT_WORKLOADS, LIMITS, PHASES, STEPS, WARMUP, CONF,
# PIN, RUNS, RUN_TIMEOUT, DEADLINE, OUT (see userjobs.py). Results: OUT/userjobs.jsonl
# and OUT/userjobs.txt (OUT defaults to BUILD_DIR/userjobs); a PASS, FAIL
# or ERROR line per run on stdout.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
need_library userjobs
export BUILD_DIR="$build"
exec "$py" "$root/bench/torch/userjobs.py"
