#!/bin/bash
# End-to-end tests of the gpumem command line on a tiny trace written here:
# exit codes (0 ok, 1 error, 2 usage), error messages that name the file and
# the line, the JSON fields, out-of-memory under a small limit, the
# min-limit bracket, summary and compare.
# usage: GPUMEM_BIN=build/gpumem bash tests/cli_test.sh SOURCE_DIR
set -u

SRC=${1:-.}
BIN=${GPUMEM_BIN:-$SRC/build/gpumem}
T_PREFIX=gpumem_cli
. "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
expect_true() { # WHAT TEST-COMMAND...
  local what=$1
  shift
  if "$@"; then ok; else bad "$what"; fi
}
expect_not_in() { # NEEDLE HAYSTACK WHAT
  case "$2" in
    *"$1"*) bad "$3: '$1' unexpectedly in: $2" ;;
    *) ok ;;
  esac
}
# json_num KEY: the number KEY has in $out (first match), or "".
json_num() { printf '%s\n' "$out" | sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p" | head -1; }

if [ ! -x "$BIN" ]; then
  echo "cli_test: no gpumem binary at $BIN (set GPUMEM_BIN)" >&2
  echo "0 passed, 1 failed"
  exit 1
fi

# A tiny trace: two "weights", then three steps of eight activations
# (1..8 MB) freed in reverse, one of them used on a side stream.
TINY=$T/tiny.trace
{
  echo "# gpumem-trace v1"
  echo "a 1000 4000000 0"
  echo "a 1001 6000000 0"
  for _ in 1 2 3; do
    for i in 0 1 2 3 4 5 6 7; do echo "a $i $(((i + 1) * 1000000)) 0"; done
    echo "r 3 5"
    for i in 7 6 5 4 3 2 1 0; do echo "f $i"; done
  done
} >"$TINY"
PEAK_LIVE=46000000
gzip -c "$TINY" >"$T/tiny.trace.gz"

# ---- usage and errors ----

run "$BIN"
expect_rc 2 "no arguments"
expect_in "usage: gpumem" "$err" "no arguments"

run "$BIN" --help
expect_rc 0 "--help"
expect_in "usage: gpumem" "$out" "--help"

run "$BIN" replay --help
expect_rc 0 "replay --help"
expect_in "--min-limit" "$out" "replay --help"

run "$BIN" frobnicate
expect_rc 2 "unknown command"
expect_in "unknown command 'frobnicate'" "$err" "unknown command"
expect_in "try 'gpumem --help'" "$err" "unknown command"

run "$BIN" replay --frobnicate "$TINY"
expect_rc 2 "unknown option"
expect_in "unknown option '--frobnicate'" "$err" "unknown option"
expect_in "try 'gpumem replay --help'" "$err" "unknown option"

run "$BIN" replay -x "$TINY"
expect_rc 2 "unknown short option"

run "$BIN" replay
expect_rc 2 "replay without a trace"

run "$BIN" replay "$TINY" --limit
expect_rc 2 "--limit without a value"

# A limit of 0 (or one that rounds to 0) is refused, not read as "none".
for zero in 0B 0.1B; do
  run "$BIN" replay "$TINY" --limit "$zero"
  expect_rc 1 "--limit $zero"
  expect_in "bad --limit '$zero': expected a size of at least 1 byte" "$err" "--limit $zero"
done

run "$BIN" summary --min-limit "$TINY"
expect_rc 2 "summary does not take --min-limit"

# A malformed line: the message names the file and the line.
BAD=$T/bad.trace
printf '# header\na 0 100 0\nf 0 7\n' >"$BAD"
run "$BIN" replay "$BAD"
expect_rc 1 "malformed line"
expect_in "gpumem: " "$err" "malformed line"
expect_in "bad.trace" "$err" "malformed line"
expect_in "line 3" "$err" "malformed line"
expect_in "extra field" "$err" "malformed line"

printf 'a 0 100 0\nf 1\n' >"$BAD"
run "$BIN" replay --json "$BAD"
expect_rc 1 "free of an unknown id"
expect_in "bad.trace: line 2: free of id 1 which is not allocated" "$err" "free of an unknown id"
expect_true "nothing on stdout after a trace error: $out" [ -z "$out" ]

gzip -c "$BAD" >"$BAD.gz"
run "$BIN" summary "$BAD.gz"
expect_rc 1 "summary of a malformed gzip trace"
expect_in "bad.trace.gz: line 2" "$err" "summary of a malformed gzip trace"

run "$BIN" replay "$T/does_not_exist.trace.gz"
expect_rc 1 "missing file"
expect_in "gpumem: " "$err" "missing file"
expect_in "does_not_exist.trace.gz" "$err" "missing file"

run "$BIN" replay --limit 12Q "$TINY"
expect_rc 1 "bad --limit"
expect_in "gpumem: " "$err" "bad --limit"
expect_in "12Q" "$err" "bad --limit"

run "$BIN" replay --limit-ratio -3 "$TINY"
expect_rc 1 "bad --limit-ratio"

run "$BIN" replay --passes many "$TINY"
expect_rc 1 "bad --passes"

run "$BIN" replay --policy fastest "$TINY"
expect_rc 1 "bad --policy"
expect_in "fastest" "$err" "bad --policy"

run "$BIN" replay --conf "bogus_key:1" "$TINY"
expect_rc 1 "bad --conf"
expect_in "gpumem: " "$err" "bad --conf"
expect_in "bogus_key" "$err" "bad --conf"

# ---- replay ----

run "$BIN" replay "$TINY"
expect_rc 0 "replay"
expect_in "peak live" "$out" "replay"
expect_in "0.043 GiB ($PEAK_LIVE bytes)" "$out" "replay peak live"
expect_in "peak reserved" "$out" "replay"
expect_in "oom             no" "$out" "replay"
# Not a terminal: no progress line, nothing at all on stderr.
expect_true "replay wrote to stderr when it is not a terminal: $err" [ -z "$err" ]

run "$BIN" replay --json --passes 2 "$T/tiny.trace.gz"
expect_rc 0 "replay --json"
for key in trace policy events allocations peak_live_bytes peak_reserved_bytes reserved_ratio \
  ns_per_op_cold ns_per_op_warm oom oom_event limit_bytes backend_calls backend_calls_warm \
  num_syncs num_alloc_retries; do
  expect_in "\"$key\":" "$out" "replay --json field $key"
done
expect_in '"events":53,' "$out" "replay --json events"
expect_in '"allocations":26,' "$out" "replay --json allocations"
expect_in "\"peak_live_bytes\":$PEAK_LIVE," "$out" "replay --json peak live"
expect_in '"oom":false' "$out" "replay --json oom"
expect_in '"limit_bytes":null' "$out" "replay --json limit"
expect_in '"policy":"default"' "$out" "replay --json policy"
expect_true "replay --json: not one line: $out" [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ]
case "$out" in "{"*"}") ok ;; *) bad "replay --json: not one object: $out" ;; esac
if command -v python3 >/dev/null 2>&1; then
  if printf '%s\n' "$out" | python3 -c 'import json,sys; [json.loads(l) for l in sys.stdin]'; then
    ok
  else
    bad "replay --json: not valid JSON: $out"
  fi
fi
RESERVED=$(json_num peak_reserved_bytes)
expect_in '"num_pages_aliased":0' "$out" "replay --json pages shared"
expect_in '"num_move_guard_trips":0' "$out" "replay --json move guard trips"
# The H100 estimate of the mapping calls: per-call costs times the calls.
if command -v python3 >/dev/null 2>&1; then
  if printf '%s\n' "$out" | python3 -c '
import json, sys
d = json.loads(sys.stdin.readline()); c = d["backend_calls"]
us = 12.7 * c["create_page"] + 35.1 * c["map"] + 19.6 * c["unmap"] + 18.4 * c["release_page"]
us += 42.9 * c["alloc"] + 38.6 * c["free"]
want = us / d["ops_cold"]
sys.exit(0 if want > 0 and abs(d["est_h100_map_us_per_op_cold"] - want) < 0.001 else 1)'; then
    ok
  else
    bad "replay --json: est_h100_map_us_per_op_cold is not the calls priced: $out"
  fi
fi

run "$BIN" replay --json --policy pytorch "$TINY" "$T/tiny.trace.gz"
expect_rc 0 "replay --json of two traces"
expect_in '"policy":"pytorch"' "$out" "replay --json --policy pytorch"
# Under pytorch the plain segments (native's cudaMalloc growth) are priced.
if command -v python3 >/dev/null 2>&1; then
  if printf '%s\n' "$out" | python3 -c '
import json, sys
d = json.loads(sys.stdin.readline()); c = d["backend_calls"]
want = (42.9 * c["alloc"] + 38.6 * c["free"]) / d["ops_cold"]
sys.exit(0 if c["alloc"] > 0 and c["map"] == 0 and abs(d["est_h100_map_us_per_op_cold"] - want) < 0.001 else 1)'; then
    ok
  else
    bad "replay --json --policy pytorch: cudaMalloc growth is not priced: $out"
  fi
fi
expect_true "two traces: not two lines: $out" [ "$(printf '%s\n' "$out" | wc -l)" -eq 2 ]

# A limit below what the trace needs: out of memory, reported, exit 0.
run "$BIN" replay --limit 20M "$TINY"
expect_rc 0 "replay under a small limit"
expect_in "oom             yes" "$out" "replay under a small limit"
expect_in "limit 0.020 GiB" "$out" "replay under a small limit"

run "$BIN" replay --json --limit-ratio 0.5 "$TINY"
expect_rc 0 "replay --limit-ratio 0.5"
expect_in '"oom":true' "$out" "replay --limit-ratio 0.5"
expect_in "\"limit_bytes\":$((PEAK_LIVE / 2))," "$out" "replay --limit-ratio 0.5"
OOM_EVENT=$(json_num oom_event)
expect_true "oom_event missing: $out" [ -n "$OOM_EVENT" ]

# The same through the configuration string.
run "$BIN" replay --json --conf "limit:20M" "$TINY"
expect_rc 0 "replay --conf limit"
expect_in '"oom":true' "$out" "replay --conf limit"

# The smallest limit lies between peak live and the unlimited reserve.
run "$BIN" replay --json --min-limit "$TINY"
expect_rc 0 "replay --min-limit"
expect_in '"min_limit_bytes":' "$out" "replay --min-limit"
expect_in '"min_limit_ratio":' "$out" "replay --min-limit"
MIN=$(json_num min_limit_bytes)
RES=$(json_num peak_reserved_bytes)
if [ -n "$MIN" ] && [ -n "$RES" ] && [ "$MIN" -ge "$PEAK_LIVE" ] && [ "$MIN" -le "$RES" ]; then
  ok
else
  bad "min limit '$MIN' not within [$PEAK_LIVE, '$RES']"
fi
expect_true "peak reserved differs between runs: $RES vs $RESERVED" [ "$RES" = "$RESERVED" ]

# It is the smallest to a page (reserved memory grows by 2 MiB pages on the
# simulated device): the limit replays, one page less runs out of memory.
run "$BIN" replay --json --passes 0 --limit "${MIN}B" "$TINY"
expect_in '"oom":false' "$out" "replay under the min limit $MIN"
run "$BIN" replay --json --passes 0 --limit "$((MIN - 2097152))B" "$TINY"
expect_in '"oom":true' "$out" "replay a page under the min limit $MIN"
run "$BIN" replay --json --min-limit-tolerance 0.5 "$TINY"
expect_rc 0 "replay --min-limit-tolerance 0.5"
expect_in '"min_limit_bytes":' "$out" "--min-limit-tolerance implies --min-limit"
for badtol in 0 1 -0.1 abc; do
  run "$BIN" replay --min-limit-tolerance "$badtol" "$TINY"
  expect_rc 1 "--min-limit-tolerance $badtol"
  expect_in "bad --min-limit-tolerance '$badtol'" "$err" "--min-limit-tolerance $badtol"
done

run "$BIN" replay --min-limit "$TINY"
expect_rc 0 "replay --min-limit (human)"
expect_in "min limit" "$out" "replay --min-limit (human)"
expect_in "x peak live" "$out" "replay --min-limit (human)"

# The real GPU: works where there is one, says why where there is none.
run "$BIN" replay --device cuda --passes 0 "$TINY"
if [ "$rc" -eq 0 ]; then
  expect_in "CUDA device" "$out" "replay --device cuda"
else
  expect_rc 1 "replay --device cuda without a GPU"
  expect_in "gpumem: " "$err" "replay --device cuda without a GPU"
  expect_in "CUDA" "$err" "replay --device cuda without a GPU"
fi

# ---- compare ----

run "$BIN" replay --compare --passes 1 "$TINY"
expect_rc 0 "replay --compare"
expect_in "reserved / live" "$out" "replay --compare"
expect_in "memory needed" "$out" "replay --compare"
expect_in "tiny" "$out" "replay --compare"
expect_not_in "OOM" "$out" "replay --compare with no limit explains no OOM"
run "$BIN" replay --compare --detail --passes 1 "$TINY"
expect_rc 0 "replay --compare --detail"
expect_in "pytorch" "$out" "replay --compare --detail"
expect_in "default" "$out" "replay --compare --detail"
expect_in "BENCHMARKS.md" "$out" "replay --compare --detail"
expect_in "tiny" "$out" "replay --compare --detail"
expect_not_in "OOM" "$out" "replay --compare --detail with no limit explains no OOM"
run "$BIN" replay --detail "$TINY"
expect_rc 2 "--detail without --compare"

run "$BIN" replay --compare --policy pytorch "$TINY"
expect_rc 2 "replay --compare with --policy"

run "$BIN" replay --compare --json --passes 1 "$TINY"
expect_rc 0 "replay --compare --json"
expect_true "compare --json: not three lines (pytorch, default, hold): $out" [ "$(printf '%s\n' "$out" | wc -l)" -eq 3 ]

# ---- steady state ----

run "$BIN" replay --steady 0 "$TINY"
expect_rc 1 "replay --steady 0"
expect_in "bad --steady '0'" "$err" "replay --steady 0"

printf 'a 1 100 0\na 2 200 0\na 3 300 0\nf 1\n' >"$T/ramp.trace"
run "$BIN" replay --passes 0 --steady 2 "$T/ramp.trace"
expect_rc 0 "replay --steady on a trace without a period"
expect_in "does not end in a repeating period" "$err" "replay --steady, no period"

run "$BIN" replay --passes 0 --steady 5 "$SRC/traces/gpt2_train.trace.gz"
expect_rc 0 "replay --steady"
expect_in "steady state    5 more steps of 1433 allocations" "$out" "replay --steady"

run "$BIN" replay --passes 0 --steady 3 --json "$SRC/traces/gpt2_train.trace.gz"
expect_in '"steady_period":1433,"steady_steps":3' "$out" "replay --steady --json"

# ---- summary ----

run "$BIN" summary --policy pytorch "$TINY"
expect_rc 0 "summary"
expect_in "tiny" "$out" "summary"
expect_true "summary too short: $out" [ "$(printf '%s\n' "$out" | wc -l)" -gt 3 ]

run "$BIN" summary --json "$TINY"
expect_rc 0 "summary --json"
case "$out" in "{"*) ok ;; *) bad "summary --json: not an object: $out" ;; esac

run "$BIN" summary "$TINY" "$TINY"
expect_rc 2 "summary of two traces"

# ---- explain --at-line: the state after a given line, not the peak ----

run "$BIN" explain --at-line 3 "$TINY"
expect_rc 0 "explain --at-line 3"
expect_in "as it stands at event 1 (line 3)" "$out" "explain --at-line names the event and line"
expect_in "requested by 2 live allocations" "$out" "explain --at-line 3: the two blocks made by then"
expect_in "cached free, pinned (mapping under live blocks)" "$out" "explain: pinned pages apart"
run "$BIN" explain --at-line 11 "$TINY"
expect_in "requested by 10 live allocations" "$out" "explain --at-line 11: the first step's blocks too"
run "$BIN" explain --at-line 1 "$TINY"
expect_rc 1 "explain --at-line before the first event"
expect_in "has no event on or before that line" "$err" "explain --at-line before the first event"
run "$BIN" explain --at-line 3x "$TINY"
expect_rc 2 "explain --at-line 3x"
expect_in "bad --at-line '3x'" "$err" "explain --at-line 3x"

run "$BIN" explain --json --at-line 11 "$TINY"
expect_rc 0 "explain --json"
if command -v python3 >/dev/null 2>&1; then
  # one object whose fields partition reserved memory, at the line asked
  if why=$(python3 - "$out" <<'PY' 2>&1
import json, sys
e = json.loads(sys.argv[1])
parts = ("requested rounding partial_pages_large partial_pages_small cached_reclaimable "
         "cached_pinned other_streams spare_pages").split()
assert e["line"] == 11 and e["live_blocks"] == 10, e
assert sum(e[k] for k in parts) == e["reserved"], e
PY
  ); then ok; else bad "explain --json: $why"; fi
fi

# ---- explain --snapshot: the state at the peak, for memory_viz ----

run "$BIN" explain --snapshot "$T/snap.pickle" "$TINY"
expect_rc 0 "explain --snapshot"
expect_in "snapshot at that event: $T/snap.pickle" "$out" "explain --snapshot"
if command -v python3 >/dev/null 2>&1; then
  # Blocks tile their segments; every live block carries one frame, the
  # trace line of the allocation that made it; segments and spare pages
  # make the reserved bytes; the live blocks are those explain counted at
  # the peak.
  live_said=$(printf '%s\n' "$out" | sed -n 's/.* requested by \([0-9]*\) live allocations.*/\1/p')
  if why=$(python3 - "$T/snap.pickle" "$TINY" "$live_said" 2>&1 <<'PY'
import pickle, sys
snap = pickle.load(open(sys.argv[1], "rb"))
alloc_lines = {n for n, l in enumerate(open(sys.argv[2]), 1) if l.startswith("a ")}
live = 0
for seg in snap["segments"]:
    at = seg["address"]
    for b in seg["blocks"]:
        assert b["address"] == at, "a gap or overlap at %d" % at
        at += b["size"]
        if b["state"] == "active_allocated":
            live += 1
            (frame,) = b["frames"]
            assert frame["line"] in alloc_lines, "frame %r is no allocation's line" % frame
            assert frame["filename"] == sys.argv[2], frame
    assert at == seg["address"] + seg["total_size"], "blocks do not fill the segment"
g = snap["gpumem"]
assert g["segment_bytes"] + g["spare_bytes"] == g["reserved_bytes"], g
assert live == int(sys.argv[3]), "%d live blocks at the peak, explain said %r" % (live, sys.argv[3])
actions = [e["action"] for e in snap["device_traces"][0]]
assert actions.count("alloc") - actions.count("free_requested") == live, actions
PY
  ); then ok; else bad "explain --snapshot: $why"; fi
fi

# The snapshot reads back as a trace: the job up to the peak, every
# allocation it made and every free.
run "$BIN" replay --json --passes 0 "$T/snap.pickle"
expect_rc 0 "replay of explain's snapshot"
if command -v python3 >/dev/null 2>&1; then
  if why=$(python3 - "$T/snap.pickle" "$out" 2>&1 <<'PY'
import json, pickle, sys
actions = [e["action"] for e in pickle.load(open(sys.argv[1], "rb"))["device_traces"][0]]
r = json.loads(sys.argv[2])
assert r["allocations"] == actions.count("alloc") > 0, (r["allocations"], actions)
PY
  ); then ok; else bad "replay of explain's snapshot: $why"; fi
fi
run "$BIN" summary "$T/snap.pickle"
expect_rc 0 "summary of explain's snapshot"

run "$BIN" explain --snapshot "$T/no/such/dir/snap.json" "$TINY"
expect_rc 1 "explain --snapshot into a missing directory"
expect_in "cannot write" "$err" "explain --snapshot into a missing directory"

# ---- leaks: what a trace leaves live ----

run "$BIN" leaks "$TINY"
expect_rc 0 "leaks"
expect_in "2 allocations made after #0 still live" "$out" "leaks"
expect_in "#2  tag 3" "$out" "leaks: the 6 MB allocation at line 3"

run "$BIN" leaks --since-line 4 "$TINY"
expect_rc 0 "leaks --since-line"
expect_in "no allocation made after #2 is live (26 made so far)" "$out" "leaks --since-line"

LEAKY=$T/leaky.trace
{
  echo "# gpumem-trace v1"
  for step in 0 1 2 3; do
    echo "a $((10 * step)) 8000000 0"
    echo "a $((10 * step + 1)) 1000000 0"
    echo "f $((10 * step))"
  done
} >"$LEAKY"
run "$BIN" leaks --since-line 5 --json "$LEAKY"
expect_rc 0 "leaks --json"
expect_in '"since":2,"made":8,"count":3,' "$out" "leaks --json"
expect_in '"requested":1000000,"stream":0,"count":3,"bytes":3001344,"requested_bytes":3000000,"first":4,"last":8,"first_tag":6,"last_tag":12' "$out" "leaks --json: the group"

run "$BIN" leaks --since-line 0 "$TINY"
expect_rc 2 "leaks --since-line 0"
expect_in "bad --since-line '0'" "$err" "leaks --since-line 0"

run "$BIN" leaks --steady 3 "$TINY"
expect_rc 2 "leaks with a replay option"

# ---- report: one HTML page ----

run "$BIN" report --min-limit -o "$T/report.html" "$TINY"
expect_rc 0 "report"
expect_in "report written to $T/report.html" "$out" "report"
page=$(cat "$T/report.html")
expect_in "<h1>gpumem report: tiny</h1>" "$page" "report: title"
expect_in "<polyline" "$page" "report: chart"
expect_in "2 allocations, 9.54 MiB, in 2 groups" "$page" "report: live at the end"
expect_in "</body></html>" "$page" "report: complete"
expect_in "<h2>Each allocator: the memory it needs</h2>" "$page" "report --min-limit: the fit table"
expect_not_in "<th>fits</th>" "$page" "report --min-limit: no fits column without --memory"
run "$BIN" report "$TINY"
expect_rc 0 "report to standard output"
expect_not_in "Each allocator" "$out" "report: no fit table unless asked for"
if command -v python3 >/dev/null 2>&1; then
  # Well formed, three series of one point per step, the min limits drawn.
  if why=$(python3 - "$T/report.html" 2>&1 <<'PY'
import re, sys
from html.parser import HTMLParser
page = open(sys.argv[1]).read()
HTMLParser().feed(page)
lines = re.findall(r'<polyline[^>]*points="([^"]+)"', page)
assert len(lines) == 3, len(lines)
for pts in lines:
    assert len(pts.split()) == 800, len(pts.split())
assert page.count('stroke-dasharray') == 2, "min limits not drawn"
rows = re.findall(r"<td class=n>(1\.\d{4})</td>", page)
assert len(rows) >= 4, rows
PY
  ); then ok; else bad "report: $why"; fi
fi

run "$BIN" report -o "$T/no/such/dir/r.html" "$TINY"
expect_rc 1 "report into a missing directory"
expect_in "cannot write" "$err" "report into a missing directory"

# Output files at names another user may have planted (docs/security.md):
# a link at the path is refused, its target untouched; so is a file other
# users can write or another name of a file (a hard link); new files are
# 0600 whatever the umask, and an own file is replaced, not written through.
echo precious >"$T/precious"
for sub in report explain; do
  ln -sf "$T/precious" "$T/$sub-link"
  if [ $sub = report ]; then
    run "$BIN" report -o "$T/$sub-link" "$TINY"
  else
    run "$BIN" explain --snapshot "$T/$sub-link" "$TINY"
  fi
  expect_rc 1 "$sub: a link at the output path"
  expect_in "refusing to write $T/$sub-link: it is a symbolic link" "$err" "$sub: a link at the output path"
  expect_true "$sub: the link's target is untouched" [ "$(cat "$T/precious")" = precious ]
  expect_true "$sub: the link stays a link" [ -L "$T/$sub-link" ]
done
echo shared >"$T/shared.html"
chmod 666 "$T/shared.html"
run "$BIN" report -o "$T/shared.html" "$TINY"
expect_rc 1 "report: a file other users can write"
expect_in "other users can write it (mode 0666)" "$err" "report: a file other users can write"
ln -f "$T/precious" "$T/hard.json"
run "$BIN" explain --snapshot "$T/hard.json" "$TINY"
expect_rc 1 "explain --snapshot: a hard link"
expect_in "it has 2 hard links" "$err" "explain --snapshot: a hard link"
expect_true "explain --snapshot: the other name is untouched" [ "$(cat "$T/precious")" = precious ]
run bash -c "umask 022; \"$BIN\" report -o \"$T/fresh.html\" \"$TINY\" && \"$BIN\" explain --snapshot \"$T/fresh.json\" \"$TINY\""
expect_rc 0 "report and explain into new files"
expect_true "report -o makes its file 0600" [ "$(stat -c %a "$T/fresh.html")" = 600 ]
expect_true "explain --snapshot makes its file 0600" [ "$(stat -c %a "$T/fresh.json")" = 600 ]
ln "$T/fresh.html" "$T/fresh-copy.html" && rm "$T/fresh-copy.html"
ino=$(stat -c %i "$T/fresh.html")
run "$BIN" report -o "$T/fresh.html" "$TINY"
expect_rc 0 "report over its own earlier file"
expect_true "report replaces its earlier file" [ "$(stat -c %i "$T/fresh.html")" != "$ino" ]
expect_true "no temporary file is left behind" [ -z "$(ls -A "$T" | grep '^\.')" ]
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
  # another user's file at the path, in a sticky directory anyone can write
  chmod 711 "$T"
  mkdir -m 1777 "$T/shared"
  setpriv --reuid=65534 --regid=65534 --clear-groups bash -c "echo theirs >$T/shared/r.html"
  run "$BIN" report -o "$T/shared/r.html" "$TINY"
  expect_rc 1 "report: another user's file"
  expect_in "belongs to uid 65534" "$err" "report: another user's file"
  expect_true "report: the other user's file is untouched" [ "$(cat "$T/shared/r.html")" = theirs ]
else
  echo "cli_test: SKIPPED report into another user's file: needs root and setpriv"
fi
if [ "$(id -u)" = 0 ]; then
  # a sticky directory anyone can write that another user owns: its owner
  # could rename the finished file away and put their own in its place
  mkdir -m 1777 "$T/msticky"
  chown 65534 "$T/msticky"
  for sub in report explain; do
    if [ $sub = report ]; then
      run "$BIN" report -o "$T/msticky/r.html" "$TINY"
    else
      run "$BIN" explain --snapshot "$T/msticky/r.pickle" "$TINY"
    fi
    expect_rc 1 "$sub: into another user's sticky directory"
    expect_in "its directory $T/msticky belongs to uid 65534" "$err" "$sub: the directory and its owner named"
    expect_true "$sub: nothing written into another user's directory" [ -z "$(ls -A "$T/msticky")" ]
  done
  run "$BIN" report -o "/tmp/gpumem_cli_$$.html" "$TINY"
  expect_rc 0 "report into /tmp itself (root's, sticky)"
  rm -f "/tmp/gpumem_cli_$$.html"
else
  echo "cli_test: SKIPPED a sticky directory another user owns: making one (chown) needs root"
fi

run "$BIN" report --conf "limt:1G" "$TINY"
expect_rc 1 "report --conf with a typo"
expect_in 'unknown key "limt"' "$err" "report --conf with a typo"

run "$BIN" report --frobnicate "$TINY"
expect_rc 2 "report with an unknown option"

# ---- PyTorch snapshots, the peer models, fit ----
SNAP="$SRC/tests/snapshots"
run "$BIN" replay --passes 0 --policy pytorch --json "$SNAP/small.pickle"
expect_rc 0 "replay a snapshot pickle"
expect_in '"recorded_peak_reserved_bytes":' "$out" "replay of a snapshot shows the recorded peak"
pk=$(echo "$out" | sed 's/.*"peak_reserved_bytes":\([0-9]*\).*/\1/')
run "$BIN" replay --passes 0 --policy pytorch --json "$SNAP/small.trace"
pt=$(echo "$out" | sed 's/.*"peak_reserved_bytes":\([0-9]*\).*/\1/')
expect_true "snapshot and trace of one sequence replay alike ($pk, $pt)" [ "$pk" = "$pt" ]
run "$BIN" replay "$SNAP/truncated.pickle"
expect_rc 1 "replay a snapshot whose ring wrapped"
expect_in "at least 5 events are lost" "$err" "a wrapped ring says how much is lost"
run "$BIN" summary "$SNAP/no_history.pickle"
expect_rc 1 "summary of a snapshot without history"
expect_in "no allocation history" "$err" "summary of a snapshot without history"

run "$BIN" replay --policy pytorch --conf EXPANDABLE_SEGMENTS:true --json "$SNAP/small.trace"
expect_rc 0 "replay the expandable segments model"
expect_in '"policy":"pytorch-expandable"' "$out" "expandable segments chosen by PyTorch's key"
run "$BIN" replay --policy async --min-limit "$SNAP/small.trace"
expect_rc 0 "replay the cudaMallocAsync model"
expect_in "cudaMallocAsync" "$out" "the async model names itself"
expect_in "min limit" "$out" "the async model's min limit"
run "$BIN" replay --policy async --limit 100M "$SNAP/small.trace"
expect_rc 0 "the async model under a small limit"
expect_in "oom             yes" "$out" "the async model runs out under a small limit"
run "$BIN" replay --policy default --conf expandable_segments:True "$SNAP/small.trace"
expect_rc 1 "expandable segments with the default policy"
expect_in "--policy pytorch" "$err" "expandable segments need the pytorch policy"
run "$BIN" replay --conf expandable_segments:maybe "$SNAP/small.trace"
expect_rc 1 "a bad expandable_segments value"
run "$BIN" summary --conf expandable_segments:True "$SNAP/small.trace"
expect_rc 1 "expandable segments only in replay and fit"

run "$BIN" fit --memory 80G "$SNAP/small.pickle"
expect_rc 0 "fit in 80G"
for row in "pytorch " "pytorch expandable" "cudaMallocAsync" "gpumem default" "gpumem pressure"; do
  expect_in "$row" "$out" "fit has a row for $row"
done
expect_in "gpumem's default needs" "$out" "fit says what gpumem's default needs"
run "$BIN" fit --memory 150M --json "$SNAP/small.trace"
expect_rc 0 "fit --json"
n=$(echo "$out" | grep -c '"fits":false')
expect_true "nothing fits in 150M (peak live 190M): $n rows say so" [ "$n" -eq 5 ]
run "$BIN" fit "$SNAP/small.trace"
expect_rc 2 "fit without --memory"

# report --memory: fit's table, row for row, on a bundled trace (peak live
# 5.641 GiB: in 5.7G the pytorch policy runs out, the others fit).
TRACE="$SRC/traces/resnet50_train.trace.gz"
run "$BIN" fit --memory 5.7G "$TRACE"
expect_rc 0 "fit of a bundled trace"
fit_out=$out
run "$BIN" report --memory 5.7G -o "$T/fit.html" "$TRACE"
expect_rc 0 "report --memory"
page=$(cat "$T/fit.html")
expect_in "<h2>Each allocator: does it fit in 5.700 GiB?</h2>" "$page" "report --memory: the fit table"
expect_in "gpumem's default needs" "$page" "report --memory says what gpumem's default needs"
for row in "pytorch" "pytorch expandable" "cudaMallocAsync" "gpumem default" "gpumem pressure"; do
  # fit's columns: name 1-20, fits 22-26, peak reserved 28-49, memory needed 51-72
  line=$(printf '%s\n' "$fit_out" | grep -E "^$row +(yes|NO) ")
  cell() { printf '%s' "$line" | cut -c"$1" | sed 's/ *$//'; }
  want="<tr><td>$row</td><td>$(cell 22-26)</td><td class=n>$(cell 28-49)</td>"
  want="$want<td class=n>$(cell 51-72)</td>"
  expect_true "fit has a row for $row" [ -n "$line" ]
  expect_in "$want" "$page" "report --memory: the row of $row as fit has it"
done
expect_in "<tr><td>pytorch</td><td>NO</td>" "$page" "report --memory: pytorch does not fit in 5.7G"
run "$BIN" report --memory 10Q "$TRACE"
expect_rc 1 "report with a bad --memory"
expect_in "bad --memory '10Q' (bytes with an optional K/M/G/T suffix" "$err" \
  "report with a bad --memory names the value"
run "$BIN" report --memory=0 "$TRACE"
expect_rc 1 "report --memory=0"
expect_in "bad --memory '0'" "$err" "report --memory=0 names the value"
run "$BIN" report "$TRACE" --memory
expect_rc 2 "report --memory without a value"
expect_in "option '--memory' needs a value" "$err" "report --memory without a value"

# ---- names from outside: never events, always shown ----
# A file name is only a name: one holding a newline and a trace line must
# not add an event to what is analysed (the figures are those of the same
# file under a plain name), and every command shows it with its control
# characters made visible, JSON escaping them its own way.
NL='
'
EVIL="job${NL}a 77777 200000000000000 0${NL}#"
mkdir "$T/names"
for b in 2 4 8; do
  cp "$SRC/tests/predict/gpt2_small_b$b.trace.gz" "$T/names/plain_b$b.trace.gz"
  cp "$SRC/tests/predict/gpt2_small_b$b.trace.gz" "$T/names/${EVIL}_b$b.trace.gz"
done
run "$BIN" predict --sizes 2,4,8 --batch 64 --json "$T"/names/plain_b{2,4,8}.trace.gz
plain_peak=$(json_num peak_live_bytes)
run "$BIN" predict --sizes 2,4,8 --batch 64 --json "$T/names/${EVIL}_b2.trace.gz" \
  "$T/names/${EVIL}_b4.trace.gz" "$T/names/${EVIL}_b8.trace.gz"
expect_rc 0 "predict over files named with a newline"
evil_peak=$(json_num peak_live_bytes)
expect_true "predict: a name adds no event (peak live $evil_peak, under a plain name $plain_peak)" \
  [ -n "$plain_peak" -a "$evil_peak" = "$plain_peak" ]
expect_in 'job\u000aa 77777' "$out" "predict --json escapes the name's newline"
run "$BIN" predict --sizes 2,4,8 --batch 64 "$T/names/${EVIL}_b2.trace.gz" \
  "$T/names/${EVIL}_b4.trace.gz" "$T/names/${EVIL}_b8.trace.gz"
expect_in 'job\x0aa 77777 200000000000000 0\x0a#_b2' "$out" "predict shows the name's newline"
expect_not_in "${NL}a 77777" "$out" "predict prints no raw newline from a name"
run "$BIN" replay --steady 3 --passes 0 "$T/names/${EVIL}_b2.trace.gz"
expect_rc 0 "replay --steady over a file named with a newline"
expect_not_in "${NL}a 77777" "$out" "replay prints no raw newline from a name"
EVILPK="snap${NL}a 77777 1000000000000 0${NL}#.pickle"
cp "$SNAP/small.pickle" "$T/names/plain.pickle"
cp "$SNAP/small.pickle" "$T/names/$EVILPK"
run "$BIN" leaks --json "$T/names/plain.pickle"
plain_leaks=$(json_num bytes)
run "$BIN" leaks --json "$T/names/$EVILPK"
expect_rc 0 "leaks of a pickle named with a newline"
expect_true "leaks: a pickle's name adds no allocation ($(json_num bytes) bytes, under a plain name $plain_leaks)" \
  [ -n "$plain_leaks" -a "$(json_num bytes)" = "$plain_leaks" ]
run "$BIN" leaks "$T/names/$EVILPK"
expect_in 'snap\x0aa 77777' "$out" "leaks shows the name's newline"
ESC="$(printf 'esc\033]0;owned\007')"
cp "$TINY" "$T/names/$ESC.trace"
for cmd in "replay --passes 0" "summary" "explain" "leaks" "fit --memory 1G"; do
  run "$BIN" $cmd "$T/names/$ESC.trace"
  expect_not_in "$(printf '\033')" "$out$err" "$cmd shows no escape sequence from a name"
done
run "$BIN" replay "$T/names/$ESC-missing.trace"
expect_in 'esc\x1b]0;owned\x07-missing.trace: cannot open' "$err" "an error shows the name's escape sequence"

# ---- run: code only from a package this user or root owns ----
# The binary built into a directory whose parent anyone can write (make
# build BUILD=/tmp/gmb): another user's WORLD/_bootstrap/sitecustomize.py
# (WORLD/.. of the binary, where an installed package would be) must not
# run; the package of the checkout is used instead.
if command -v python3 >/dev/null; then
  chmod 711 "$T"
  mkdir -m 1777 "$T/world"
  mkdir "$T/world/gmb"
  cp "$BIN" "$T/world/gmb/gpumem"
  plant='mkdir -p "$0/_bootstrap" && touch "$0/__init__.py" &&
    printf "open(\"%s\", \"w\").write(\"ran\")\n" "$0/pwned" >"$0/_bootstrap/sitecustomize.py"'
  if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
    setpriv --reuid=65534 --regid=65534 --clear-groups bash -c "$plant" "$T/world"
  else
    bash -c "$plant" "$T/world"
  fi
  run "$T/world/gmb/gpumem" run -- python3 -c 'import sys; print(sys.path[1])'
  expect_rc 0 "run from a binary below a directory anyone can write"
  expect_true "run did not run another user's sitecustomize.py" [ ! -e "$T/world/pwned" ]
  expect_in "python/gpumem/_bootstrap" "$out" "run put the checkout's hook on PYTHONPATH instead"
  expect_not_in "$T/world/_bootstrap" "$out" "run did not put the planted hook on PYTHONPATH"
else
  echo "cli_test: SKIPPED run from a binary below a shared directory: no python3"
fi

# ---- what the command line says is what it did ----

want_version=$(sed -n 's/^project(gpumem VERSION \([0-9.]*\).*/\1/p' "$SRC/CMakeLists.txt")
for flag in --version -V; do
  run "$BIN" $flag
  expect_rc 0 "gpumem $flag"
  expect_true "gpumem $flag says '$out', CMakeLists.txt $want_version" \
    [ -n "$want_version" -a "$out" = "gpumem $want_version" ]
done

# A size without a unit is refused with the likely meaning, never taken as bytes.
run "$BIN" fit --memory 80 "$TINY"
expect_rc 1 "fit --memory 80"
expect_in "bad --memory '80': 80 bytes: did you mean 80G? write 80B for bytes" "$err" "fit --memory 80"
expect_true "fit --memory 80 printed a table: $out" [ -z "$out" ]
for args in "replay --limit 80" "replay --capacity 80" "summary --limit 80" "replay --conf limit:80" \
  "explain --conf map_max:2097152" "report --memory 80" "report --conf limit:80"; do
  run "$BIN" $args "$TINY"
  expect_rc 1 "$args"
  expect_in "did you mean" "$err" "$args"
done
# A bare zero is the same in every unit.
run "$BIN" replay --json --passes 0 --conf map_ahead:0 "$TINY"
expect_rc 0 "replay --conf map_ahead:0"
run "$BIN" replay --policy pytorch --conf map_ahead:off "$TINY"
expect_rc 1 "replay --policy pytorch --conf map_ahead:off"
expect_in "key 'map_ahead' does not apply to the pytorch policy" "$err" "map_ahead under pytorch"
run "$BIN" replay --policy pytorch --conf lend:off "$TINY"
expect_rc 1 "replay --policy pytorch --conf lend:off"
expect_in "key 'lend' does not apply to the pytorch policy" "$err" "lend under pytorch"
run "$BIN" run --conf limit:80 -- true
expect_rc 2 "run --conf limit:80"
expect_in "did you mean 80G" "$err" "run --conf limit:80"
run "$BIN" replay --json --passes 0 --limit "${PEAK_LIVE}B" "$TINY"
expect_rc 0 "replay --limit in bytes with B"
expect_in "\"limit_bytes\":$PEAK_LIVE," "$out" "replay --limit ${PEAK_LIVE}B"

# GPUMEM_CONF: applied by the offline commands, under --conf, under the flags.
run env GPUMEM_CONF=limit:20M "$BIN" replay --json --passes 0 "$TINY"
expect_rc 0 "GPUMEM_CONF=limit:20M replay"
expect_in '"limit_bytes":20971520,' "$out" "GPUMEM_CONF's limit applies to replay"
expect_in '"oom":true' "$out" "GPUMEM_CONF's limit applies to replay"
run env GPUMEM_CONF=limit:20M "$BIN" replay --json --passes 0 --conf limit:1G "$TINY"
expect_in '"limit_bytes":1073741824,' "$out" "--conf wins over GPUMEM_CONF"
run env GPUMEM_CONF=limit:20M "$BIN" replay --json --passes 0 --conf limit:1G --limit 30M "$TINY"
expect_in '"limit_bytes":31457280,' "$out" "--limit wins over --conf and GPUMEM_CONF"
run env GPUMEM_CONF=policy:pytorch "$BIN" summary "$TINY"
expect_in "(policy pytorch," "$out" "GPUMEM_CONF applies to summary"
run env GPUMEM_CONF=policy:pytorch "$BIN" explain "$TINY"
expect_in "policy pytorch" "$out" "GPUMEM_CONF applies to explain"
run env GPUMEM_CONF=policy:pytorch "$BIN" leaks "$TINY"
expect_in "(policy pytorch;" "$out" "GPUMEM_CONF applies to leaks"
run env GPUMEM_CONF=limit:1G "$BIN" fit --memory 1G --json "$TINY"
expect_rc 0 "fit under a GPUMEM_CONF"
expect_in "GPUMEM_CONF is not applied" "$err" "fit says it runs each allocator at its own settings"
# A bad GPUMEM_CONF is refused by every command, by name; --help still answers.
for cmd in "replay $TINY" "summary $TINY" "explain $TINY" "leaks $TINY" "fit --memory 1G $TINY" \
  "report $TINY" "top --once" "run -- true"; do
  run env GPUMEM_CONF=limit:abc "$BIN" $cmd
  expect_rc 1 "GPUMEM_CONF=limit:abc gpumem $cmd"
  expect_in "bad GPUMEM_CONF 'limit:abc'" "$err" "GPUMEM_CONF=limit:abc gpumem $cmd"
done
run env GPUMEM_CONF=limit:abc "$BIN" replay --help
expect_rc 0 "replay --help under a bad GPUMEM_CONF"
# run: the processes get GPUMEM_CONF, then --conf (whose keys win).
run env GPUMEM_CONF=reclaim:eager "$BIN" run --conf limit:1G -- sh -c 'echo "$GPUMEM_CONF"'
if [ "$rc" -eq 0 ]; then
  expect_in "reclaim:eager,limit:1G" "$out" "run passes GPUMEM_CONF then --conf"
else
  expect_in "cannot find the gpumem Python package" "$err" "gpumem run"
fi

# The models of other allocators: each key applied or refused by name.
SMALL="$SRC/tests/snapshots/small.trace"
run "$BIN" replay --policy pytorch --limit 100M --conf expandable_segments:True "$SMALL"
by_flag=$out
run "$BIN" replay --policy pytorch --conf expandable_segments:True,limit:100M "$SMALL"
expect_rc 0 "expandable segments with limit in --conf"
expect_in "limit 0.098 GiB" "$out" "the expandable model applies --conf's limit"
expect_in "oom             yes" "$out" "the expandable model runs out under --conf's limit"
expect_true "limit in --conf and --limit differ: $out / $by_flag" [ "$out" = "$by_flag" ]
run "$BIN" replay --policy async --capacity 100M "$SMALL"
expect_in "oom             yes" "$out" "the async model runs out of the simulated device's --capacity"
expect_in "no limit" "$out" "the device's memory is no limit"
run "$BIN" replay --policy async --capacity 1G --conf fraction:0.1 "$SMALL"
expect_in "limit 0.100 GiB" "$out" "the async model applies the fraction of --capacity"
run "$BIN" replay --policy pytorch --conf expandable_segments:True,max_split_size_mb:20 "$SMALL"
expect_rc 1 "max_split_size_mb under the expandable model"
expect_in "'max_split_size_mb' does not apply to the pytorch-expandable model" "$err" \
  "max_split_size_mb under the expandable model is refused by name"
run "$BIN" replay --policy async --conf max_split_size_mb:20 "$SMALL"
expect_rc 1 "max_split_size_mb under the async model"
expect_in "cudaMallocAsync has no such setting" "$err" "max_split_size_mb under async"
run env GPUMEM_CONF=reclaim:eager "$BIN" replay --policy async "$SMALL"
expect_rc 1 "a gpumem key from GPUMEM_CONF under the async model"
expect_in "GPUMEM_CONF key 'reclaim' does not apply to the cudaMallocAsync model" "$err" \
  "a gpumem key from GPUMEM_CONF under the async model"
run "$BIN" replay --conf expandable_segments:True "$SMALL"
expect_rc 1 "expandable_segments without --policy"
expect_in "give it with --policy pytorch" "$err" "expandable_segments without --policy"
run "$BIN" replay --policy async --conf expandable_segments:True "$SMALL"
expect_rc 1 "expandable_segments with --policy async"
expect_in "give one or the other" "$err" "expandable_segments with --policy async"
run "$BIN" replay --conf policy:pytorch,expandable_segments:True --json "$SMALL"
expect_in '"policy":"pytorch-expandable"' "$out" "policy:pytorch in --conf selects the model too"
# its growth priced per page, as PyTorch creates and maps each: the figure is
# the pages times one page's price over the trace's operations
pages=$(json_num pages_mapped)
priced=$(json_num est_h100_map_us_per_op_cold)
ops=$(grep -c '^[af] ' "$SMALL")
expect_true "the expandable model's $pages pages at 43.9 us over $ops operations: $priced us/op" \
  python3 -c "import sys; p, u, n = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]);
sys.exit(not (p > 0 and abs(u - 43.9 * p / n) < 0.0006))" "${pages:-0}" "${priced:-0}" "$ops"
run "$BIN" replay --policy pytorch --conf expandable_segments:True "$SMALL"
expect_in "pages, each created and mapped" "$out" "the expandable model's text names its pages"
run "$BIN" replay --policy async --json "$SMALL"
expect_not_in "est_h100_map_us_per_op_cold" "$out" "the async model's growth is not priced"

# record: would write the replay over the recording it reads; refused.
cp "$TINY" "$T/rec.trace"
for cmd in replay summary explain leaks report; do
  run env GPUMEM_CONF="record:$T/rec.trace" "$BIN" $cmd "$T/rec.trace"
  expect_rc 1 "GPUMEM_CONF=record: gpumem $cmd"
  expect_in "GPUMEM_CONF key 'record' would record this replay" "$err" "GPUMEM_CONF=record: gpumem $cmd"
done
run "$BIN" replay --conf "record:$T/rec.trace" "$T/rec.trace"
expect_rc 1 "replay --conf record:"
expect_in "--conf key 'record'" "$err" "replay --conf record:"
expect_true "the recording was left as it was" cmp -s "$TINY" "$T/rec.trace"

# The engine's policies: a key one of them has nothing to act on is refused.
run "$BIN" replay --conf max_split_size_mb:20 "$SMALL"
expect_rc 1 "max_split_size_mb under the default policy"
expect_in "'max_split_size_mb' does not apply to the default policy" "$err" \
  "max_split_size_mb under the default policy is refused by name"
run "$BIN" replay --passes 0 --policy pytorch --conf max_split_size_mb:20 "$SMALL"
expect_rc 0 "max_split_size_mb under the pytorch policy"
run "$BIN" replay --policy pytorch --conf placement:planned "$SMALL"
expect_rc 1 "placement under the pytorch policy"
expect_in "--conf key 'placement' does not apply to the pytorch policy" "$err" \
  "placement under the pytorch policy is refused by name"
run env GPUMEM_CONF=reclaim:pressure "$BIN" summary --policy pytorch "$SMALL"
expect_rc 1 "GPUMEM_CONF's reclaim under summary --policy pytorch"
expect_in "GPUMEM_CONF key 'reclaim' does not apply to the pytorch policy" "$err" \
  "GPUMEM_CONF's reclaim under the pytorch policy is refused by name"
run "$BIN" replay --compare --passes 0 --conf placement:bestfit "$SMALL"
expect_rc 0 "replay --compare takes the default policy's keys"

# --compare: the header says the limit the figures were made under; the
# help and the JSON name the third column as the table does.
run "$BIN" replay --compare --passes 0 --conf limit:30M "$TINY"
expect_in "(simulated device, limit 0.029 GiB" "$out" "replay --compare under --conf limit"
expect_in "OOM: ran out of memory under the limit 0.029 GiB" "$out" "replay --compare explains its OOM"
run "$BIN" replay --compare --detail --passes 0 --conf limit:30M "$TINY"
expect_in "(simulated device, limit 0.029 GiB)" "$out" "replay --compare --detail under --conf limit"
expect_not_in "no limit" "$out" "replay --compare under --conf limit"
run env GPUMEM_CONF=limit:30M "$BIN" replay --compare --passes 0 "$TINY"
expect_in "(simulated device, limit 0.029 GiB" "$out" "replay --compare under GPUMEM_CONF"
run "$BIN" replay --help
compare_help=$(printf '%s\n' "$out" | sed -n '/--compare/,/-h, --help/p')
expect_in "hold" "$compare_help" "replay --help names --compare's hold column"
expect_not_in "reclaim:pressure" "$compare_help" "replay --help: --compare shows no reclaim:pressure column"
run "$BIN" replay --compare --json --passes 0 "$TINY"
n=0
for col in pytorch default hold; do
  line=$(printf '%s\n' "$out" | grep "\"column\":\"$col\"")
  [ -n "$line" ] && n=$((n + 1))
done
expect_true "compare --json: each line names its column: $out" [ "$n" -eq 3 ]
expect_in '"column":"hold","conf":"placement:planned,move_budget:unlimited,headroom:0.002"' "$out" \
  "compare --json: the hold rows carry their setting"

# A wrong combination: its reason and where to look, not the whole usage.
run "$BIN" replay --passes 0 --policy async "$TINY"
expect_rc 2 "replay --passes 0 --policy async"
expect_true "a usage mistake takes two lines, not the usage: $err" [ "$(printf '%s\n' "$err" | wc -l)" -eq 2 ]
expect_in "try 'gpumem replay --help'" "$err" "a usage mistake points to --help"
expect_not_in "usage:" "$err" "a usage mistake does not print the usage"
for args in "top --bogus" "top --interval"; do
  run "$BIN" $args
  expect_rc 2 "$args"
  expect_in "try 'gpumem top --help'" "$err" "$args points to --help"
  expect_not_in "usage:" "$err" "$args does not print the usage"
done
run "$BIN" replay --compare --step-ms 10 --steps 3 "$TINY"
expect_rc 2 "--step-ms with --compare"
expect_in "--step-ms" "$err" "--step-ms with --compare"
run "$BIN" replay --policy async --step-ms 10 --steps 3 "$TINY"
expect_rc 2 "--step-ms with --policy async"
expect_in "no device calls to price" "$err" "--step-ms with --policy async"
run "$BIN" leaks --since-line 55 "$TINY"
expect_rc 2 "leaks --since-line past the end"
expect_in "the last event of $TINY is at line 54" "$err" "leaks --since-line past the end"
run "$BIN" leaks --since-line 54 "$TINY"
expect_rc 0 "leaks --since-line at the last line"

echo "cli_test: $PASS passed, $FAIL failed"
[ "$FAIL" -eq 0 ]
