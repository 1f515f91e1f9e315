"""The README's three paths ("### 1." to "### 3."), run as written: each
```sh or ```python block runs in the given directory with the given gpumem on
PATH, and every line of the ```text block after it must be a line of what it
printed (blanks at the ends of lines aside). A path the machine cannot run
(no PyTorch for path 1) is skipped with the reason printed.

usage: python3 readme_paths.py README CHECKOUT BIN_DIR PYTHON [--installed] [--no-python]

BIN_DIR holds the `gpumem` to run; PYTHON runs the python blocks and
`python` in the sh blocks. --installed: the package is installed already,
by the README's own `pip install .` (the caller ran it), so that line is
taken as done; without it a pip line fails the path. --no-python: the
package cannot be loaded here (a sanitizer build's library): the paths that
import it are skipped, saying so.
"""
import os
import re
import subprocess
import sys
import tempfile

README, CHECKOUT, BIN_DIR, PYTHON = sys.argv[1:5]
INSTALLED = "--installed" in sys.argv[5:]
NO_PYTHON = "--no-python" in sys.argv[5:]
passed = failed = skipped = 0


def paths(text):
    """{number: [(kind, body), ...]} for the README's '### N.' sections."""
    out = {}
    for m in re.finditer(r"^### (\d)\. [^\n]*\n(.*?)(?=^##)", text, re.S | re.M):
        out[int(m.group(1))] = re.findall(r"^```(\w+)\n(.*?)^```", m.group(2), re.S | re.M)
    return out


SHIMS = tempfile.mkdtemp(prefix="gpumem-readme-python-")


def run(kind, body, workdir):
    env = dict(os.environ)
    env["PATH"] = BIN_DIR + os.pathsep + os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
    if kind == "python":
        cmd = [PYTHON, "-c", body]
    else:
        # `python` in the README is the interpreter the package is installed in
        shim = os.path.join(SHIMS, "bin")
        os.makedirs(shim, exist_ok=True)
        wrapper = os.path.join(shim, "python")
        if not os.path.exists(wrapper):
            # a script, not a link: a virtual environment's python knows itself by its path
            with open(wrapper, "w") as f:
                f.write('#!/bin/sh\nexec "%s" "$@"\n' % PYTHON)
            os.chmod(wrapper, 0o755)
        env["PATH"] = shim + os.pathsep + env["PATH"]
        cmd = ["bash", "-c", body]
    p = subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=600)
    return p.returncode, p.stdout


def check(number, blocks, workdir):
    global passed, failed
    for i, (kind, body) in enumerate(blocks):
        if kind not in ("sh", "python"):
            continue
        expected = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else None
        if expected is None:
            continue  # an example to copy, with no output shown (path 3's micro-batches)
        lines = []
        for line in body.splitlines():
            if re.match(r"\s*pip install \.(\s|$)", line):
                if not INSTALLED:
                    failed += 1
                    print(f"readme_paths: FAIL: path {number}: '{line.strip()}' was not run first")
                    return
                continue
            lines.append(line)
        rc, out = run(kind, "\n".join(lines), workdir)
        got = {line.rstrip() for line in out.splitlines()}
        missing = [line for line in expected.splitlines() if line.strip() and line.rstrip() not in got]
        if missing:
            failed += 1
            print(f"readme_paths: FAIL: path {number}: the README shows lines its {kind} block did not print "
                  f"(exit {rc}):\n  " + "\n  ".join(missing) + "\nit printed:\n" + out)
        else:
            passed += 1
            print(f"readme_paths: path {number}: {len(expected.splitlines())} lines as the README shows them")


def main():
    global skipped
    with open(README) as f:
        found = paths(f.read())
    if sorted(found) != [1, 2, 3]:
        print(f"readme_paths: FAIL: the README has paths {sorted(found)}, not 1, 2 and 3")
        print("0 passed, 1 failed")
        return 1
    with tempfile.TemporaryDirectory(prefix="gpumem-readme-") as tmp:
        for number in (1, 2, 3):
            if NO_PYTHON and number in (1, 3):
                skipped += 1
                print(f"readme_paths: SKIPPED path {number}: it imports the package, whose library "
                      "this build cannot load into a plain python (a sanitizer build)")
                continue
            # the paths name files of the checkout (recordings) from its root; path 1 runs a
            # train.py of its own, made here
            work = tmp if number == 1 else CHECKOUT
            if number == 1:
                probe = subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.is_available())"],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                if probe.returncode != 0:
                    skipped += 1
                    print("readme_paths: SKIPPED path 1: PyTorch is not installed for " + PYTHON)
                    continue
                if probe.stdout.strip() == "True":
                    skipped += 1
                    print("readme_paths: SKIPPED path 1: this machine has a GPU; the README shows the "
                          "answer of one without")
                    continue
                with open(os.path.join(work, "train.py"), "w") as f:
                    f.write("import torch\nprint(torch.zeros(2, device='cuda'))\n")
            check(number, found[number], work)
    subprocess.run(["rm", "-rf", SHIMS])
    print(f"readme_paths: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


sys.exit(main())
