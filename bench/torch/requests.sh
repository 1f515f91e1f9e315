#!/usr/bin/env bash
# What the allocator costs per request through torch's allocator interface:
# the bundled traces' requests (bench/torch/alloc_replay.py), native and
# gpumem in turn, one process each, ROUNDS rounds (default 3). One JSON
# line per process and trace.
#
#   bash bench/torch/requests.sh [BUILD_DIR]          (default: build)
set -u
. "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${1:-}"
need_library requests
for _ in $(seq "${ROUNDS:-3}"); do
  for allocator in native gpumem; do
    "$py" "$root/bench/torch/alloc_replay.py" --allocator "$allocator" "$root"/traces/*.trace.gz ||
      exit 1
  done
done
