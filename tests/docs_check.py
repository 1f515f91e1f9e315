"""The figures README.md, BENCHMARKS.md and docs/ quote from the simulated
device, against what the program prints now (tests/docs_test.sh runs the
commands and passes their output here). A figure is matched at the
precision it is quoted with, rounded or cut: "1.003" stands for 1.0037.
Each check names the file and the phrase, so a stale figure says where it is.

usage: python3 docs_check.py SRC COMPARE.jsonl PRESSURE.jsonl FIT.txt [SYNTH.jsonl]
"""
import json
import math
import os
import re
import sys

SRC, COMPARE, PRESSURE, FIT = sys.argv[1:5]
SYNTH = sys.argv[5] if len(sys.argv) > 5 else None
failures = 0
checked = 0


def fail(where, msg):
    global failures
    failures += 1
    print(f"FAIL: {where}: {msg}", file=sys.stderr)


def read(name):
    with open(f"{SRC}/{name}") as f:
        return f.read()


def rows(path):
    """JSON lines of a replay: {(name, column or policy): row}."""
    out = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            out[(d["name"], d.get("column", d["policy"]))] = d
    return out


def same(quoted, actual):
    """Whether quoted (text) is actual at quoted's precision, rounded or cut."""
    d = len(quoted.split(".")[1]) if "." in quoted else 0
    step = 10.0**-d
    q = float(quoted)
    return abs(q - round(actual, d)) < step / 2 or abs(q - math.floor(actual / step + 1e-9) * step) < step / 2


def expect(where, quoted, actual, what):
    global checked
    checked += 1
    if not same(quoted, actual):
        fail(where, f"quotes {quoted} for {what}; the program gives {actual:.4f}")


def find(where, text, pattern):
    # a phrase may be wrapped anywhere: a space in the pattern is any run of white space
    # and a number ends before a sentence's full stop
    pattern = pattern.replace(" ", r"\s+").replace(r"([\d.]+)", r"(\d+(?:\.\d+)?)")
    m = re.search(pattern, text, re.S)
    if not m:
        fail(where, f"no longer says /{pattern}/: update tests/docs_check.py with the text")
    return m


def expect_range(where, text, pattern, values, what):
    m = find(where, text, pattern)
    if m:
        expect(where, m.group(1), min(values), what + " (lowest)")
        expect(where, m.group(2), max(values), what + " (highest)")


def table_rows(text, first):
    """The cells of the markdown table rows whose first cell is first."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            out.append(cells)
    return out


compare = rows(COMPARE)
pressure = rows(PRESSURE)
bundled = sorted({name for name, _ in compare})
col = lambda c, key: [compare[(n, c)][key] for n in bundled]
default_reserved = col("default", "reserved_ratio")
default_min = col("default", "min_limit_ratio")
hold_reserved = col("hold", "reserved_ratio")
hold_min = col("hold", "min_limit_ratio")
hold_us = col("hold", "est_h100_map_us_per_op_cold")
pytorch_vs_h200 = [abs(compare[(n, "pytorch")]["reserved_ratio"] / compare[(n, "pytorch")]["h200_pytorch_reserved_ratio"] - 1)
                   for n in bundled]

# ---- README.md ----
readme = read("README.md")
W = "README.md"
# The intro quotes the Results table of the same page: the two must agree.
native, ours = [], []
for line in readme.split("## Results", 1)[1].split("\n## ", 1)[0].splitlines():
    cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
    if len(cells) == 4 and re.fullmatch(r"\d\.\d+", cells[1] or "") and re.fullmatch(r"\d\.\d+", cells[2] or ""):
        native.append(float(cells[1]))
        ours.append(float(cells[2]))
m = find(W, readme, r"\(([\d.]+)-([\d.]+) x the bytes a job has allocated where PyTorch reserves ([\d.]+)-([\d.]+) x")
if m and ours:
    expect(W, m.group(1), min(ours), "gpumem's lowest in the Results table")
    expect(W, m.group(2), max(ours), "gpumem's highest in the Results table")
    expect(W, m.group(3), min(native), "native's lowest in the Results table")
    expect(W, m.group(4), max(native), "native's highest in the Results table")
m = find(W, readme, r"fits a job in\s+([\d.]+)-([\d.]+)% over its\s+live bytes")
if m:
    expect(W, m.group(1), 100 * (min(default_min) - 1), "the default's min limit over live, %")
    expect(W, m.group(2), 100 * (max(default_min) - 1), "the default's min limit over live, %")
# The default policy's figures: docs/configuration.md.
config = read("docs/configuration.md")
C = "docs/configuration.md"
expect_range(C, config, r"the address space the job walks,\s+([\d.]+)-([\d.]+) x peak live on the bundled traces",
             default_reserved, "the default's reserved / peak live")
expect_range(C, config, r"jobs fit in ([\d.]+)-([\d.]+) x their live bytes", default_min, "the default's min limit")
m = find(C, config, r"`([^`]+)` holds reserved memory at the\s+high-water mark whatever the moves cost \(([\d.]+)-([\d.]+) x, at ([\d.]+)-([\d.]+) us")
if m:
    hold_conf = compare[(bundled[0], "hold")]["conf"]
    if m.group(1) != hold_conf:
        fail(C, f"names the hold setting `{m.group(1)}`; the program's hold column is `{hold_conf}`")
    expect(C, m.group(2), min(hold_reserved), "hold's reserved (lowest)")
    expect(C, m.group(3), max(hold_reserved), "hold's reserved (highest)")
    expect(C, m.group(4), min(hold_us), "hold's first-pass us/op (lowest)")
    expect(C, m.group(5), max(hold_us), "hold's first-pass us/op (highest)")
# (the exception, where there is one, is named: "... on every bundled trace but NAME")
m = find(C, config, r"than PyTorch spends in cudaMalloc growth, on every bundled trace(?: but (\w+))?")
for name in bundled:
    checked += 1
    d, p = compare[(name, "default")], compare[(name, "pytorch")]
    cheaper = d["est_h100_map_us_per_op_cold"] < p["est_h100_map_us_per_op_cold"]
    if m and name == m.group(1):
        if cheaper:
            fail(C, f"says the default's first pass costs more than PyTorch's growth on {name}; it costs less")
    elif not cheaper:
        fail(C, f"says the default's first pass costs less than PyTorch's growth on every bundled trace but "
                f"{m.group(1) if m else '?'}; not on {name}")
for where, text, pattern in ((W, readme, r"to within ([\d.]+)% \(`make demo`\)"),
                             (C, config, r"to within ([\d.]+)% \(`make demo`\)"),
                             ("docs/whatif.md", read("docs/whatif.md"), r"its rules exactly; ([\d.]+)% of the H200's peaks"),
                             ("BENCHMARKS.md", read("BENCHMARKS.md"), r"on an H200 \(next section\) to within ([\d.]+)% on every trace")):
    m = find(where, text, pattern)
    if m:
        checked += 1
        q = m.group(1)
        d = len(q.split(".")[1]) if "." in q else 0
        worst = 100 * max(pytorch_vs_h200)
        if float(q) != math.ceil(worst * 10**d - 1e-9) / 10**d:
            fail(where, f"says the pytorch policy is within {q}% of the H200; the program gives {worst:.4f}%")

# The install lines: pip's path is the checkout (pyproject.toml at its root),
# make build names the files it makes, and CMake's flags go through make.
for m in re.finditer(r"pip install (\.[^\s`]*)", readme):
    checked += 1
    if not os.path.isfile(os.path.join(SRC, m.group(1), "pyproject.toml")):
        fail(W, f"'pip install {m.group(1)}' from the checkout: no pyproject.toml at {m.group(1)}")
m = find(W, readme, r"make build +# ([^\n]+)")
build = os.environ.get("GPUMEM_BUILD")
if m and build:
    for f in re.findall(r"build/([\w.-]+)", m.group(1)):
        checked += 1
        if not os.path.exists(os.path.join(build, f)):
            fail(W, f"says make build makes build/{f}; {build} has no {f}")
for m in re.finditer(r"(\S+\s+\S+)\s+`?CMAKE_FLAGS=-D", readme):
    checked += 1
    if " ".join(m.group(1).strip("`").split()) != "make build":
        fail(W, f"gives CMAKE_FLAGS after '{m.group(1)}', not as 'make build CMAKE_FLAGS=...'")

# ---- docs/design.md ----
design = read("docs/design.md")
W = "docs/design.md"
expect_range(W, design, r"\| `lazy` \(default\) \|[^|]*\| ([\d.]+)-([\d.]+) x peak live \(bundled traces",
             default_reserved, "the default (lazy) reserved / peak live")
expect_range(W, design, r"the address space walked: ([\d.]+)-([\d.]+) x",
             [pressure[(n, "default")]["reserved_ratio"] for n in bundled], "reclaim:pressure's reserved / peak live")
for label, hold, default in (("bundled traces, no limit", hold_reserved, default_reserved),
                             ("smallest limit that fits", hold_min, default_min)):
    for cells in table_rows(design, label) or [None]:
        if cells is None:
            fail(W, f"has no '{label}' row")
            continue
        for cell, values, what in ((cells[1], hold, "hold"), (cells[2], default, "default")):
            m = re.fullmatch(r"([\d.]+)-([\d.]+)", cell)
            if not m:
                fail(W, f"'{label}' {what}: '{cell}' is not a range")
                continue
            expect(W, m.group(1), min(values), f"'{label}', {what} (lowest)")
            expect(W, m.group(2), max(values), f"'{label}', {what} (highest)")
second_half = col("default", "est_h100_map_us_per_op_cold_second_half")
expect_range(W, design, r"second half \(a long job's steady state\) is ([\d.]+)-([\d.]+) us\s+per operation under the default on the four above",
             second_half, "the default's second-half us/op")
m = find(W, design, r"native's on the same trace: ([\d.]+), ([\d.]+), ([\d.]+) and ([\d.]+) us/op on the four above")
if m:
    for q, n in zip(m.groups(), bundled):
        expect(W, q, compare[(n, "pytorch")]["est_h100_map_us_per_op_cold"], f"{n}: the pytorch policy's us/op")

# The per-trace tables of design.md and BENCHMARKS.md, cell by cell.
bench = read("BENCHMARKS.md")
for where, text, fields in (
        ("docs/design.md", design, [("default", "reserved_ratio"), ("hold", "reserved_ratio"),
                                    ("default", "est_h100_map_us_per_op_cold"),
                                    ("hold", "est_h100_map_us_per_op_cold"), ("default", "min_limit_ratio")]),
        ("BENCHMARKS.md", bench, [(None, "peak_live_bytes"), ("pytorch", "reserved_ratio"),
                                  ("default", "reserved_ratio"), ("hold", "reserved_ratio"), (None, "anchor"),
                                  ("default", "est_h100_map_us_per_op_cold"),
                                  ("hold", "est_h100_map_us_per_op_cold"),
                                  ("default", "est_h100_map_us_per_op_cold_second_half"),
                                  ("default", "min_limit_ratio")])):
    for n in bundled:
        found = table_rows(text, n)
        if not found:
            fail(where, f"has no row for {n}")
        for cells in found[:1]:
            for cell, (column, key) in zip(cells[1:], fields):
                if key == "anchor":
                    continue  # measured on the H200: checked against the Peers table below
                row = compare[(n, column or "default")]
                if key == "peak_live_bytes":
                    expect(where, cell.split()[0], row[key] / 2**30, f"{n}: peak live GiB")
                else:
                    expect(where, cell, row[key], f"{n}: {column} {key}")
m = find("BENCHMARKS.md", bench, r"\(`replay --compare --detail`\) it is ([\d.]+) \(gpt2\), ([\d.]+) \(llama\), ([\d.]+) \(resnet\)\s+and ([\d.]+) \(t5\) against gpumem's ([\d.]+), ([\d.]+), ([\d.]+) and ([\d.]+)")
if m:
    for i, n in enumerate(bundled):
        expect("BENCHMARKS.md", m.group(1 + i), compare[(n, "pytorch")]["est_h100_map_us_per_op_cold"], f"{n}: pytorch us/op")
        expect("BENCHMARKS.md", m.group(5 + i), compare[(n, "default")]["est_h100_map_us_per_op_cold"], f"{n}: default us/op")

# The H200 columns `replay --compare` prints come from BENCHMARKS.md's Peers table.
peers = bench.split("## Peers", 1)[1].split("\n## ", 1)[0]
for n in bundled:
    found = table_rows(peers, n)
    if not found:
        fail("BENCHMARKS.md", f"Peers has no row for {n}")
        continue
    torch_r, exp_r, async_r = (float(c) for c in found[0][1:4])
    row = compare[(n, "pytorch")]
    checked += 2
    if row["h200_pytorch_reserved_ratio"] != torch_r or row["h200_best_peer_reserved_ratio"] != min(exp_r, async_r):
        fail("tools/replay_output.c", f"{n}: the H200 figures replay --compare prints differ from BENCHMARKS.md's Peers table")

# GPU figures quoted from the Peers table elsewhere must be the table's.
peer_cols = {"torch": [], "torch_exp": [], "async": []}
for n in bundled:
    for cells in table_rows(peers, n)[:1]:
        for k, cell in zip(("torch", "torch_exp", "async"), cells[1:4]):
            peer_cols[k].append(float(cell))
expect_range("README.md", readme, r"expandable segments reserve ([\d.]+)-([\d.]+) x peak live,", peer_cols["torch_exp"],
             "expandable segments in BENCHMARKS.md's Peers table")
expect_range("README.md", readme, r"x peak live, cudaMallocAsync ([\d.]+)-([\d.]+) x\.", peer_cols["async"],
             "cudaMallocAsync in BENCHMARKS.md's Peers table")
for cells in table_rows(design, "bundled traces, no limit")[:1]:
    for cell, k in ((cells[3], "torch"), (cells[4], "torch_exp")):
        lo, hi = cell.split("-")
        expect("docs/design.md", lo, min(peer_cols[k]), f"{k} in BENCHMARKS.md's Peers table (lowest)")
        expect("docs/design.md", hi, max(peer_cols[k]), f"{k} in BENCHMARKS.md's Peers table (highest)")

# ---- docs/whatif.md: the example of gpumem fit, line for line ----
whatif = read("docs/whatif.md")
example = re.split(r"checks these lines against it\):", whatif, 1)
fit_out = open(FIT).read()
if len(example) < 2:
    fail("docs/whatif.md", "has no 'Example, gpt2_train in 13.5 GiB:'")
else:
    # the indented lines after the marker, blank ones between them included
    shown = []
    for line in example[1].strip("\n").splitlines():
        if line.strip() and not line.startswith("    "):
            break
        shown.append(line)
    for line in shown:
        checked += 1
        if line.strip() and line.strip() not in [l.strip() for l in fit_out.splitlines()]:
            fail("docs/whatif.md", f"fit example line not in the program's output: {line.strip()}")

# ---- the synthetic workloads (BENCHMARKS.md, README.md, design.md) ----
if SYNTH:
    synth = rows(SYNTH)
    names = sorted({name for name, _ in synth})
    for n in names:
        # (the synthetic workloads' own table: seven columns; other tables name them too)
        found = [cells for cells in table_rows(bench, n) if len(cells) == 7]
        if not found:
            fail("BENCHMARKS.md", f"has no row for {n}")
            continue
        cells = found[0]
        d, p = synth[(n, "default")], synth[(n, "pytorch")]
        expect("BENCHMARKS.md", cells[1].split()[0], d["peak_live_bytes"] / 2**30, f"{n}: peak live GiB")
        for cell, value, what in ((cells[2], d["reserved_ratio"], "reserved"),
                                  (cells[3], d["est_h100_map_us_per_op_cold"], "us/op 1st pass"),
                                  (cells[4], d["est_h100_map_us_per_op_cold_second_half"], "us/op 2nd half"),
                                  (cells[5], d["min_limit_ratio"], "min limit"),
                                  (cells[6], p["est_h100_map_us_per_op_cold"], "pytorch us/op")):
            expect("BENCHMARKS.md", cell, value, f"{n}: {what}")
    m = find("docs/limitations.md", read("docs/limitations.md"),
             r"\(synth_random ([\d.]+) x peak live on the simulated device\)")
    if m:
        expect("docs/limitations.md", m.group(1), synth[("synth_random", "default")]["reserved_ratio"], "synth_random reserved")
    m = find("docs/design.md", design, r"at most ([\d.]+) on the synthetic workloads")
    if m:
        expect("docs/design.md", m.group(1),
               max(synth[(n, "default")]["est_h100_map_us_per_op_cold_second_half"] for n in names),
               "the synthetic workloads' second-half us/op")
    m = find("docs/design.md", design, r"([\d.]+) and ([\d.]+) on synth_streams and synth_varlen, where gpumem's are ([\d.]+) and ([\d.]+)")
    if m:
        expect(W, m.group(1), synth[("synth_streams", "pytorch")]["est_h100_map_us_per_op_cold"], "synth_streams pytorch us/op")
        expect(W, m.group(2), synth[("synth_varlen", "pytorch")]["est_h100_map_us_per_op_cold"], "synth_varlen pytorch us/op")
        expect(W, m.group(3), synth[("synth_streams", "default")]["est_h100_map_us_per_op_cold"], "synth_streams default us/op")
        expect(W, m.group(4), synth[("synth_varlen", "default")]["est_h100_map_us_per_op_cold"], "synth_varlen default us/op")

print(f"docs_check: {checked} figures checked, {failures} wrong")
sys.exit(1 if failures else 0)
