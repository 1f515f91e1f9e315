#!/usr/bin/env bash
# The Python package's tests (python/tests: standard-library unittest, no
# GPU) against a build's libgpumem.so.
#
#   bash tests/test_python.sh [BUILD_DIR] [GROUP]     (default: build, all)
#
# GROUP splits the suite so that make test runs its halves side by side:
# "only:GLOB,..." runs the test files matching one of the globs, and
# "except:GLOB,..." the others.
#
# Same as `GPUMEM_LIBRARY=BUILD_DIR/libgpumem.so python3 -m unittest
# discover -s python/tests -v`, through a small runner so that the last
# line is "python: N passed, N failed, N skipped" and the exit status is
# nonzero when anything failed (or nothing ran).
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
case "$build" in /*) ;; *) build="$PWD/$build" ;; esac
lib="$build/libgpumem.so"
py="${PYTHON:-python3}"

if [ ! -f "$lib" ]; then
  echo "test_python: $lib not found: build the library first (make build)" >&2
  echo "python: 0 passed, 1 failed"
  exit 1
fi
if ! command -v "$py" >/dev/null 2>&1; then
  echo "test_python: $py not found" >&2
  echo "python: 0 passed, 1 failed"
  exit 1
fi

cd "$root"
GPUMEM_LIBRARY="$lib" PYTHONDONTWRITEBYTECODE=1 "$py" - "$root/python/tests" "${2:-except:}" <<'PY'
import fnmatch
import os
import sys
import unittest

start, group = sys.argv[1], sys.argv[2]
how, _, globs = group.partition(":")
globs = [g for g in globs.split(",") if g]
if how not in ("only", "except"):
    sys.exit("test_python: bad GROUP %r (only:GLOB,... or except:GLOB,...)" % group)
suite = unittest.TestSuite()
for name in sorted(os.listdir(start)):
    if not fnmatch.fnmatch(name, "test*.py"):
        continue
    hit = any(fnmatch.fnmatch(name, g) for g in globs)
    if hit == (how == "only"):
        suite.addTests(unittest.defaultTestLoader.discover(start, pattern=name, top_level_dir=start))
result = unittest.TextTestRunner(verbosity=2).run(suite)
failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
skipped = len(result.skipped)
passed = result.testsRun - failed - skipped - len(result.expectedFailures)
print("python: %d passed, %d failed, %d skipped" % (passed, failed, skipped))
sys.exit(1 if failed or result.testsRun == 0 else 0)
PY
