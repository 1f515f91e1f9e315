#!/usr/bin/env bash
# pip installs gpumem as a new user would, from a clean copy of the checkout
# (the files git tracks, plus new ones it does not ignore: no build/), into
# a virtual environment that sees the system's packages, offline:
#
#   python3 -m venv --system-site-packages v
#   v/bin/pip install --no-build-isolation --no-index <copy>
#
# then, with no environment but PATH, runs the installed command line and
# the package:
#
#   v/bin/gpumem replay traces/gpt2_train.trace.gz
#   v/bin/python -c "import gpumem; a = gpumem.Allocator(); a.free(a.malloc(1 << 20))"
#
# and the README's three paths as written, with the installed gpumem and
# python (tests/readme_paths.py: what they print must hold the lines the
# README shows).
#
#   bash tests/test_pip_install.sh [SOURCE_DIR]      (default: this checkout)
#
# Exits 77 (CTest: skipped), saying why, where python3's venv or pip is
# missing (Debian: apt-get install python3-venv python3-pip).
set -u
root="$(cd "${1:-$(dirname "${BASH_SOURCE[0]}")/..}" && pwd)"
py="${PYTHON:-python3}"
skip() {
  echo "test_pip_install: SKIPPED: $*"
  exit 77
}
fail() {
  echo "test_pip_install: FAIL: $*"
  exit 1
}

command -v "$py" >/dev/null 2>&1 || skip "no $py"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpumem-pip-XXXXXX")"
trap 'rm -rf "$work"' EXIT

# A clean clone of the working tree.
mkdir "$work/src"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$root" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf -) | tar -xf - -C "$work/src" || fail "copying the checkout"
else
  (cd "$root" && tar --exclude=./build --exclude='./build-*' --exclude=./.git -cf - .) |
    tar -xf - -C "$work/src" || fail "copying the checkout"
fi

if ! "$py" -m venv --system-site-packages "$work/v" >"$work/venv.log" 2>&1; then
  skip "'$py -m venv' cannot make a virtual environment with pip (Debian: apt-get install" \
    "python3-venv): $(tail -n 1 "$work/venv.log")"
fi
[ -x "$work/v/bin/pip" ] || skip "the virtual environment has no pip (apt-get install python3-pip python3-venv)"

# Nothing from the caller's environment that could point at another build.
clean=(env -i "PATH=$PATH" "HOME=$work/home" "TMPDIR=$work")
mkdir "$work/home"
start=$(date +%s)
if ! "${clean[@]}" "$work/v/bin/pip" install --no-build-isolation --no-index --no-cache-dir \
  --disable-pip-version-check "$work/src" >"$work/pip.log" 2>&1; then
  tail -n 40 "$work/pip.log"
  fail "pip install --no-build-isolation --no-index failed (log above)"
fi
echo "test_pip_install: pip install took $(($(date +%s) - start)) s"

# The two commands, with no environment variables but PATH.
bare=(env -i "PATH=/usr/bin:/bin")
cd "$work/src"
out="$("${bare[@]}" "$work/v/bin/gpumem" replay traces/gpt2_train.trace.gz 2>&1)" ||
  fail "v/bin/gpumem replay failed: $out"
echo "$out" | grep -q "peak reserved" || fail "gpumem replay printed no peak reserved line: $out"
echo "test_pip_install: v/bin/gpumem replay traces/gpt2_train.trace.gz: ok"

out="$("${bare[@]}" "$work/v/bin/python" -c \
  "import gpumem; a = gpumem.Allocator(); a.free(a.malloc(1 << 20)); print(gpumem.library_path())" 2>&1)" ||
  fail "import gpumem / Allocator failed: $out"
site="$("${bare[@]}" "$work/v/bin/python" -c "import gpumem, os; print(os.path.dirname(gpumem.__file__))")"
case "$site" in
  "$work/v/"*) ;;
  *) fail "gpumem was imported from $site, not the virtual environment" ;;
esac
[ "$out" = "$site/libgpumem.so" ] || fail "the package loaded $out, not the library installed with it ($site)"
echo "test_pip_install: v/bin/python -c 'import gpumem; ...': ok (library $out)"

# The C++ that gpumem.torch compiles at first use travels with the package.
for f in csrc/shim.cpp csrc/allocator.cpp; do
  cmp -s "$site/$f" "$root/python/gpumem/$f" || fail "the installed package lacks $f (or differs)"
done
echo "test_pip_install: the package carries csrc/shim.cpp and csrc/allocator.cpp"

# The command line shipped in the package knows `run`, and finds the package.
"${bare[@]}" "$work/v/bin/gpumem" run -- "$work/v/bin/python" -c \
  "import os, sys; assert os.environ['GPUMEM_ENABLE_TORCH'] == '1'; import gpumem; print(gpumem.__file__)" \
  >"$work/run.out" 2>&1 || fail "gpumem run failed: $(cat "$work/run.out")"
grep -q "^$site/__init__.py\$" "$work/run.out" || fail "gpumem run loaded $(cat "$work/run.out")"
echo "test_pip_install: v/bin/gpumem run -- python: ok"

# The README's three paths, from this installation.
"${bare[@]}" "HOME=$work/home" "TMPDIR=$work" "$py" "$root/tests/readme_paths.py" \
  "$work/src/README.md" "$work/src" "$work/v/bin" "$work/v/bin/python" --installed \
  >"$work/paths.out" 2>&1 || fail "the README's paths: $(cat "$work/paths.out")"
sed 's/^/  /' "$work/paths.out"
echo "test_pip_install: PASS"
