# Sourced by the bench/torch runners (`. bench/torch/env.sh "$1"`): sets
# root (the repository), build (the build directory: the argument, default
# build), py (the Python to run) and the environment every workload process
# gets; need_library NAME stops NAME when gpumem is not built.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build}"
case "$build" in /*) ;; *) build="$PWD/$build" ;; esac
py="${PYTHON:-python3}"
export GPUMEM_LIBRARY="${GPUMEM_LIBRARY:-$build/libgpumem.so}"
export GPUMEM_CACHE_DIR="${GPUMEM_CACHE_DIR:-$build/gpumem-cache}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

need_library() {
  if [ ! -f "$GPUMEM_LIBRARY" ]; then
    echo "$1: $GPUMEM_LIBRARY not found: build gpumem first (make build)" >&2
    exit 1
  fi
}
