#!/usr/bin/env bash
# The C++ that gpumem.torch.enable() compiles at first use (python/gpumem/
# csrc: the shim and the full allocator), compile-checked against the
# installed PyTorch's headers with the definitions enable() would put in
# front. A CPU build of PyTorch ships the headers but not c10/cuda's
# generated cuda_cmake_macros.h, which a stand-in replaces; the CUDA runtime
# headers come from the CUDA toolkit. Skipped (77) without torch, a C++
# compiler or CUDA's headers, saying which.
#
#   bash tests/test_torch_csrc.sh REPO_ROOT
set -u
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
py="${PYTHON:-python3}"
cxx="${CXX:-$(command -v g++ || command -v c++ || true)}"
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "torch_csrc: skipped: PyTorch is not installed (pip install torch)"
  exit 77
fi
if [ -z "$cxx" ]; then
  echo "torch_csrc: skipped: no C++ compiler"
  exit 77
fi
cuda_inc=""
for d in "${CUDA_HOME:-/usr/local/cuda}/include" /usr/local/cuda/include /usr/include; do
  if [ -f "$d/cuda_runtime_api.h" ]; then cuda_inc="$d"; break; fi
done
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/stub/c10/cuda/impl"
echo '#define C10_CUDA_BUILD_SHARED_LIBS' >"$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
PYTHONPATH="$root/python" "$py" - "$tmp" "$cxx" "$cuda_inc" <<'PY'
import os, subprocess, sys
tmp, cxx, cuda_inc = sys.argv[1:4]
import gpumem.torch as gt
from torch.utils import cpp_extension
try:
    inc = list(cpp_extension.include_paths())
except TypeError:
    inc = list(cpp_extension.include_paths(False))
stub = os.path.join(tmp, "stub")
have_stub = os.path.exists(os.path.join(inc[0], "c10", "cuda", "impl", "cuda_cmake_macros.h"))
failed = checked = 0
for name, source, extra in (("shim.cpp", gt._shim_source, []), ("allocator.cpp", gt._graphs_source, ["cuda"])):
    if extra and not cuda_inc:
        print("torch_csrc: %s not checked: no CUDA runtime headers (cuda_runtime_api.h)" % name)
        continue
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(source())
    cmd = [cxx, "-std=c++20", "-fsyntax-only", path] + ["-I" + p for p in inc]
    if not have_stub:
        cmd.append("-I" + stub)
    if extra:
        cmd.append("-I" + cuda_inc)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    checked += 1
    if r.returncode != 0:
        failed += 1
        print("torch_csrc: %s does not compile:\n%s" % (name, r.stdout[-4000:]))
    else:
        print("torch_csrc: %s compiles against torch %s" % (name, __import__("torch").__version__))
print("torch_csrc: %d passed, %d failed" % (checked - failed, failed))
sys.exit(1 if failed or not checked else 0)
PY
