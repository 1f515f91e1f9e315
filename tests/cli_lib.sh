# The checks the command line's shell tests share (tests/cli_test.sh,
# tests/predict_test.sh): sourced after setting T_PREFIX; sets PASS, FAIL
# and T (a temporary directory removed at exit).
PASS=0
FAIL=0
T=$(mktemp -d "${TMPDIR:-/tmp}/${T_PREFIX:-gpumem_test}.XXXXXX")
trap 'rm -rf "$T"' EXIT

ok() { PASS=$((PASS + 1)); }
bad() {
  FAIL=$((FAIL + 1))
  echo "FAIL: $*" >&2
}

# run CMD...: runs it with stdin closed; sets rc, out, err.
run() {
  "$@" </dev/null >"$T/out" 2>"$T/err"
  rc=$?
  out=$(cat "$T/out")
  err=$(cat "$T/err")
}
expect_rc() { # WANT WHAT
  if [ "$rc" -eq "$1" ]; then ok; else bad "$2: exit $rc, want $1; stderr: $err"; fi
}
expect_in() { # NEEDLE HAYSTACK WHAT
  case "$2" in
    *"$1"*) ok ;;
    *) bad "$3: '$1' not in: $2" ;;
  esac
}
