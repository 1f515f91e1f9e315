#!/bin/bash
# The figures the docs quote from the simulated device against what the
# program prints now: runs the commands the docs show (make demo's replay
# --compare of the bundled traces, with the min limit; reclaim:pressure;
# the fit example of docs/whatif.md; make synth's workloads) and hands
# their output to tests/docs_check.py, which finds each quoted figure; the
# example of docs/predict.md is checked here, line for line.
# GPU figures are measured elsewhere and named with their script and date;
# they are not checked here.
# usage: bash tests/docs_test.sh SOURCE_DIR GPUMEM_BIN [BENCH_SYNTH]
set -u
SRC=$1
BIN=$2
SYNTH=${3:-}
if ! command -v python3 >/dev/null 2>&1; then
  echo "docs_test: skipped, no python3"
  exit 77
fi
T=$(mktemp -d "${TMPDIR:-/tmp}/gpumem_docs.XXXXXX")
trap 'rm -rf "$T"' EXIT
die() {
  echo "FAIL: $*" >&2
  exit 1
}

# The README's `make build` builds the library and the command line alone
# (the tests and benchmarks come with `make test`), and make's directory
# lines stay out of the output.
build_cmds=$(make -s -C "$SRC" -n build BUILD="$T/b" 2>/dev/null) || die "make -n build failed"
case "$build_cmds" in
  *"--target gpumem gpumem_static gpumem_cli"*) ;;
  *) die "make build no longer builds the library and the command line alone: $build_cmds" ;;
esac
grep -q -- '--no-print-directory' "$SRC/Makefile" || die "the Makefile prints make's directory lines"

"$BIN" replay --compare --min-limit --passes 0 --json "$SRC"/traces/*.trace.gz >"$T/compare.jsonl" ||
  die "gpumem replay --compare of the bundled traces failed"
"$BIN" replay --passes 0 --json --conf reclaim:pressure "$SRC"/traces/*.trace.gz >"$T/pressure.jsonl" ||
  die "gpumem replay --conf reclaim:pressure failed"
"$BIN" fit --memory 13.5G "$SRC/traces/gpt2_train.trace.gz" >"$T/fit.txt" || die "gpumem fit failed"
# docs/predict.md's example, line for line: the job of tests/predict_job.sh
# recorded at 2, 4 and 8, predicted at 64 and in 1G.
for b in 2 4 8; do
  bash "$SRC/tests/predict_job.sh" $b >"$T/job_b$b.trace" || die "tests/predict_job.sh failed"
done
"$BIN" predict --sizes 2,4,8 "$T/job_b2.trace" "$T/job_b4.trace" "$T/job_b8.trace" --batch 64 \
  --memory 1G >"$T/predict.txt" || die "gpumem predict failed"
# the indented lines after "checks these lines against it):", up to the next paragraph
awk '/checks these lines against it\):/ { on = 1; next }
     on && /^    / { print substr($0, 5); next }
     on && NF { exit }' "$SRC/docs/predict.md" >"$T/predict_example.txt"
[ -s "$T/predict_example.txt" ] || die "docs/predict.md has no example marked 'checks these lines against it):'"
sed 's/[[:space:]]*$//' "$T/predict.txt" >"$T/predict_out.txt"
while IFS= read -r line; do
  [ -z "$line" ] && continue
  grep -Fxq -- "$line" "$T/predict_out.txt" ||
    die "docs/predict.md: example line not in the program's output: $line"
done <"$T/predict_example.txt"
set -- "$SRC" "$T/compare.jsonl" "$T/pressure.jsonl" "$T/fit.txt"
if [ -n "$SYNTH" ]; then
  mkdir "$T/synth" && "$SYNTH" "$T/synth" >/dev/null || die "bench_synth failed"
  "$BIN" replay --compare --min-limit --passes 0 --json "$T"/synth/*.trace >"$T/synth.jsonl" ||
    die "gpumem replay --compare of the synthetic workloads failed"
  set -- "$@" "$T/synth.jsonl"
  # BENCHMARKS.md's tables of the bundled, synthetic and recorded jobs, row for row: the peers
  # beside the default, and which settings meet the bounds on which traces (and on the test
  # snapshot pickle: a job read from a snapshot is held to the same bounds). GPUMEM_DOCS_TABLES=0,
  # the sanitizer build's, leaves them to the plain build, whose replays give the same figures.
  tables="memory_vs_peers bounds_by_setting"
  if [ "${GPUMEM_DOCS_TABLES:-1}" = 0 ]; then
    echo "docs_test: skipped: BENCHMARKS.md's tables (the plain build checks them; the same replays)"
    tables=
  fi
  for script in $tables; do
    inputs=("$SRC"/traces/*.trace.gz "$T"/synth/*.trace "$SRC"/traces/jobs/*.trace.gz "$SRC"/traces/decode/*.trace.gz)
    [ "$script" = bounds_by_setting ] && inputs+=("$SRC/tests/snapshots/small.pickle")
    python3 "$SRC/bench/$script.py" --gpumem "$BIN" "${inputs[@]}" >"$T/$script.md" ||
      die "bench/$script.py failed"
    grep '^| ' "$T/$script.md" | while IFS= read -r row; do
      grep -Fxq -- "$row" "$SRC/BENCHMARKS.md" || echo "BENCHMARKS.md: row not as bench/$script.py prints it: $row"
    done >"$T/missing.txt"
    if [ -s "$T/missing.txt" ]; then die "$(cat "$T/missing.txt")"; fi
  done
fi
GPUMEM_BUILD=$(dirname "$BIN") python3 "$SRC/tests/docs_check.py" "$@" || exit 1
# The README's three paths, from the build (as "From a checkout without
# installing" says): what they print holds the lines the README shows.
# GPUMEM_DOCS_LIBRARY: the shared library for the Python paths; set empty
# (a sanitizer build's, which a plain python cannot load) they are skipped.
mkdir "$T/bin" && ln -s "$BIN" "$T/bin/gpumem"
lib=${GPUMEM_DOCS_LIBRARY-"$(dirname "$BIN")/libgpumem.so"}
PYTHONPATH="$SRC/python" GPUMEM_LIBRARY="$lib" \
  python3 "$SRC/tests/readme_paths.py" "$SRC/README.md" "$SRC" "$T/bin" "$(command -v python3)" --installed \
  $([ -n "$lib" ] || echo --no-python)
