#!/usr/bin/env bash
# gpumem under PyTorch and CuPy on a real GPU: loss equality with native
# PyTorch (GPT-2 small, ResNet-50), out-of-memory and recovery, the
# torch.cuda memory functions, CuPy arrays, and two-GPU DDP over NCCL.
# Tests whose requirements are missing (torch, a GPU, CuPy, transformers,
# torchvision, a second GPU) are reported as skipped, with the reason.
#
#   bash tests/gpu/torch/run.sh [BUILD_DIR]     (default: build)
#
# The last line is "torch: N passed, N failed, N skipped". Exit status: 1
# when a test failed, 77 when every test was skipped (no torch or no GPU:
# what CTest's SKIP_RETURN_CODE 77 reports as skipped), else 0.
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
build="${1:-$root/build}"
case "$build" in /*) ;; *) build="$PWD/$build" ;; esac
lib="$build/libgpumem.so"
py="${PYTHON:-python3}"
if [ ! -f "$lib" ]; then
  echo "gpu/torch: $lib not found: build the library first (make build)" >&2
  echo "torch: 0 passed, 1 failed"
  exit 1
fi
cd "$root"
export GPUMEM_LIBRARY="$lib"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
# The first enable() compiles the C++ shim against the installed torch;
# keep it out of the user's cache unless asked.
export GPUMEM_CACHE_DIR="${GPUMEM_CACHE_DIR:-$build/gpumem-cache}"
"$py" - "$root/tests/gpu/torch" <<'PY'
import sys
import unittest

start = sys.argv[1]
suite = unittest.defaultTestLoader.discover(start, pattern="test_*.py", top_level_dir=start)
result = unittest.TextTestRunner(verbosity=2).run(suite)
failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
skipped = len(result.skipped)
passed = result.testsRun - failed - skipped - len(result.expectedFailures)
for test, why in result.skipped:
    print("skipped: %s: %s" % (test.id().split(".", 1)[-1], why))
print("torch: %d passed, %d failed, %d skipped" % (passed, failed, skipped))
sys.exit(1 if failed else 77 if passed == 0 and skipped else 0)
PY
