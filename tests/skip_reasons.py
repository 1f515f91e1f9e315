"""After a ctest run: every skip, with its reason, as the tests printed it.

CTest shows only the output of failed tests, so a test skipped whole (exit
77), or one that skipped a part of itself where the machine lacks what it
needs (no GPU, not root, no PyTorch), would say nothing of it. Each test
prints its skips with the reason; this finds those lines in the run's log.

usage: python3 skip_reasons.py BUILD_DIR
"""
import re
import sys

log_path = sys.argv[1] + "/Testing/Temporary/LastTest.log"
try:
    with open(log_path, errors="replace") as f:
        log = f.read()
except OSError as e:
    print(f"skip_reasons: cannot read {log_path}: {e.strerror}")
    sys.exit(0)

said = 0
pattern = re.compile(r"\bskip(ped|s)?\b", re.I)
for m in re.finditer(r"^\d+/\d+ Test: (\S+)\n.*?^Output:\n-+\n(.*?)^<end of output>", log, re.S | re.M):
    name, output = m.groups()
    reasons = {}  # reason: how many times, in the order first seen
    for line in output.splitlines():
        # tallies ("N passed, N failed, N skipped", unittest's "OK (skipped=N)") say how many
        if not pattern.search(line) or re.search(r"\d+ passed, \d+ failed|\(skipped=\d+\)", line):
            continue
        # a unittest test that ran, whose description speaks of skipping ("... ok")
        if re.search(r"\.\.\. (ok|FAIL|ERROR|expected failure)$", line):
            continue
        # unittest: "test_x (module.Class.test_x) ... skipped 'why'"
        # and a runner's summary of them, "skipped: Class.test_x: why": said once
        u = re.search(r"\.\.\. skipped '(.*)'$", line)
        if u:
            reason = f"skipped: {u.group(1)}"
        elif re.match(r"skipped: [\w.]+: ", line):
            continue
        else:
            reason = line.strip()[:300]
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, n in reasons.items():
        if not said:
            print("Skipped, and why:")
        said += 1
        print(f"  {name}: {reason}" + (f" ({n} tests)" if n > 1 else ""))
if not said:
    print("Skipped: nothing.")
