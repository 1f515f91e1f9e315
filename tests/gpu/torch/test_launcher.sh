#!/usr/bin/env bash
# gpumem installed with pip and enabled from outside an unedited PyTorch
# program, on a GPU: pip installs this checkout into a virtual environment
# that sees the system's torch (--system-site-packages --no-build-isolation
# --no-index), then trains GPT-2 small (bench/torch/workloads.py, its own
# allocator left at native so that only the launcher can enable gpumem) for
# a few steps under each way of launching:
#
#   1. python -m gpumem.torch --verbose bench/torch/workloads.py gpt2_train ...
#   2. python -m torch.distributed.run --nproc-per-node 1 -m gpumem.torch ...   (torchrun)
#   3. gpumem run --verbose -- python bench/torch/workloads.py gpt2_train ...
#   4. gpumem run --verbose -- torchrun --nproc-per-node 1 bench/torch/workloads.py ...
#
# Each passes when the process said gpumem was enabled, reported its peak
# memory at exit, and the workload trained without running out of memory
# with peak reserved within 2% of peak allocated (gpumem's figures: PyTorch's
# own allocator reserves ~12% more on this workload).
#
#   bash tests/gpu/torch/test_launcher.sh        (from the repository root; ~3 min)
#
# Prints "PASS name" / "FAIL name: why" / "SKIP name: why" lines and
# "launcher: N passed, N failed, N skipped"; logs go to $OUT (default
# /tmp/gpumem-launcher). Exit 1 when something failed, 77 when there is no
# torch or GPU.
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
out="${OUT:-/tmp/gpumem-launcher}"
mkdir -p "$out"
py="${PYTHON:-python3}"
steps="${STEPS:-5}"
passed=0 failed=0 skipped=0
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1: $2"; failed=$((failed + 1)); }
skip() { echo "SKIP $1: $2"; skipped=$((skipped + 1)); }
finish() {
  echo "launcher: $passed passed, $failed failed, $skipped skipped"
  [ "$failed" -gt 0 ] && exit 1
  [ "$passed" -eq 0 ] && exit 77
  exit 0
}

if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  skip all "no torch with a CUDA GPU for $py"
  finish
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/gpumem-launcher-XXXXXX")"
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export GPUMEM_CACHE_DIR="$work/cache"
unset GPUMEM_LIBRARY GPUMEM_CONF PYTHONPATH

# ---- install -------------------------------------------------------------------
start=$(date +%s)
v="$work/v"
if "$py" -m venv --system-site-packages "$v" >"$out/pip.log" 2>&1 && [ -x "$v/bin/pip" ]; then
  pip=("$v/bin/pip")
else
  # No ensurepip for this Python: a venv without pip, filled by the system's.
  rm -rf "$v"
  "$py" -m venv --without-pip --system-site-packages "$v" >>"$out/pip.log" 2>&1
  pip=("$py" -m pip --python "$v/bin/python")
fi
# --system-site-packages gives the base interpreter's packages; where the
# system's Python is itself a virtual environment (torch installed in it),
# its site directories are added with a .pth file, as a user would.
if ! "$v/bin/python" -c "import torch" 2>/dev/null && "$py" -c "import torch" 2>/dev/null; then
  "$py" -c "import site; print('\n'.join(site.getsitepackages()))" \
    >"$("$v/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/system_site.pth"
fi
if "${pip[@]}" install --no-build-isolation --no-index --no-cache-dir "$root" >>"$out/pip.log" 2>&1 &&
  [ -x "$v/bin/gpumem" ]; then
  pass "pip install --no-build-isolation --no-index (took $(($(date +%s) - start)) s)"
else
  tail -n 30 "$out/pip.log"
  fail "pip install" "see $out/pip.log"
  finish
fi

# ---- the launches --------------------------------------------------------------
workload=(bench/torch/workloads.py gpt2_train --steps "$steps" --warmup 2)

# check NAME LOG EXPECTED_ENABLED_LINES: the verbose lines and the JSON result.
check() {
  local name="$1" log="$2" want="$3"
  local enabled peaks
  enabled=$(grep -c "gpumem: enabled as PyTorch's CUDA allocator" "$log")
  peaks=$(grep -c "gpumem: device 0: peak allocated" "$log")
  if [ "$enabled" -lt "$want" ]; then
    fail "$name" "gpumem was not enabled ($enabled 'enabled' lines, wanted $want; $log)"
    return
  fi
  if [ "$peaks" -lt 1 ]; then
    fail "$name" "no peak memory report at exit ($log)"
    return
  fi
  local verdict
  verdict=$(grep '^{"workload"' "$log" | tail -n 1 | "$py" -c '
import json, sys
line = sys.stdin.read().strip()
if not line:
    print("no JSON result line"); sys.exit()
r = json.loads(line)
ratio = r["peak_reserved"] / max(r["peak_allocated"], 1)
if r["oom"]:
    print("ran out of memory: %s" % r["oom_message"])
elif ratio > 1.10:  # native PyTorch: ~1.12 x on this job; gpumem uncapped: ~1.07 x
    print("peak reserved %.4f x peak allocated: not gpumem figures" % ratio)
else:
    print("ok: %d steps, median %.1f ms, peak reserved %.2f GiB = %.4f x peak allocated"
          % (r["steps"], r["median_ms"], r["peak_reserved"] / 2**30, ratio))
')
  case "$verdict" in
    ok:*) pass "$name (${verdict#ok: }; $(grep "gpumem: device 0" "$log" | tail -n 1 | sed 's/^.*gpumem: //'))" ;;
    *) fail "$name" "$verdict ($log)" ;;
  esac
}

cd "$root"
log="$out/1_python_m_gpumem_torch.log"
timeout 300 "$v/bin/python" -m gpumem.torch --verbose "${workload[@]}" >"$log" 2>&1
check "python -m gpumem.torch script.py" "$log" 1

log="$out/2_torchrun_m_gpumem_torch.log"
timeout 300 "$v/bin/python" -m torch.distributed.run --nproc-per-node 1 -m gpumem.torch --verbose \
  "${workload[@]}" >"$log" 2>&1
check "torchrun --nproc-per-node 1 -m gpumem.torch script.py" "$log" 1

log="$out/3_gpumem_run_python.log"
timeout 300 "$v/bin/gpumem" run --verbose -- "$v/bin/python" "${workload[@]}" >"$log" 2>&1
check "gpumem run -- python script.py" "$log" 1

# torchrun's own agent imports torch too, so it also says "enabled": 2 lines.
log="$out/4_gpumem_run_torchrun.log"
timeout 300 "$v/bin/gpumem" run --verbose -- "$v/bin/python" -m torch.distributed.run --nproc-per-node 1 \
  "${workload[@]}" >"$log" 2>&1
check "gpumem run -- torchrun --nproc-per-node 1 script.py" "$log" 2

finish
