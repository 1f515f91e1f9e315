"""The README's walk-through on a GPU machine, checked against the job itself:

    python3 bench/torch/predict_example_check.py [--memory 80G] [--hog-gib 4] [--json OUT]

Runs `python -m gpumem.predict --memory M --batch-sizes 2,4,8 --batch 64
bench/torch/predict_example.py --batch-size {B}` on the GPU while another
process holds --hog-gib GiB of it (0: none), as a GPU shared with a notebook
or another job is; then runs the example itself for 3 steps, in a process
of its own each: at batch 64 with no cap under PyTorch's allocator,
expandable segments and gpumem (torch.cuda.max_memory_reserved), and under
the memory the table says the allocator has (--memory less the context it
measured, as a per-process fraction) at each allocator's predicted largest
batch and at one ~10% step above it. Prints the command's output, then one
JSON line per run; --json writes them all."""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(HERE, "predict_example.py")
ROWS = {"native": "pytorch", "expandable": "pytorch expandable", "gpumem": "gpumem default"}

RUN = """
import json, os, runpy, sys
b, cap, allocator = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if allocator == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch
if allocator == "gpumem":
    import gpumem.torch
    gpumem.torch.enable()
if cap:
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.mem_get_info()[1])
sys.argv = [%r, "--batch-size", str(b), "--steps", "3"]
out = {"batch": b, "cap_bytes": cap, "allocator": allocator}
try:
    runpy.run_path(%r, run_name="__main__")
    out["oom"] = False
except torch.OutOfMemoryError:
    out["oom"] = True
out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
print(json.dumps(out))
""" % (EXAMPLE, EXAMPLE)

HOG = """
import sys, torch
x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(ROOT, "python") + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def run_example(batch, cap, allocator):
    done = subprocess.run([sys.executable, "-c", RUN, str(batch), str(cap), allocator], env=env(),
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)  # fmt: skip
    lines = done.stdout.decode().strip().splitlines()
    return json.loads(lines[-1]) if done.returncode == 0 and lines else {
        "batch": batch, "allocator": allocator, "error": "exit status %d" % done.returncode}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memory", default="80G")
    ap.add_argument("--hog-gib", type=float, default=4)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():  # (no CUDA context made: the command's own is what it measures)
        sys.exit("predict_example_check: no GPU: this checks the command's GPU path against the job run there")
    hog = None
    if a.hog_gib > 0:
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(a.hog_gib)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)  # fmt: skip
        if hog.stdout.readline().strip() != b"ready":
            sys.exit("predict_example_check: the process holding %g GiB did not start" % a.hog_gib)
    start = time.time()
    try:
        cmd = [sys.executable, "-m", "gpumem.predict", "--memory", a.memory, "--batch-sizes", "2,4,8",
               "--batch", "64", EXAMPLE, "--batch-size", "{B}"]  # fmt: skip
        done = subprocess.run(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    finally:
        if hog:
            hog.stdin.close()
            hog.wait()
    text = done.stdout.decode("utf-8", "replace")
    print(text + "(%d s, exit status %d)" % (time.time() - start, done.returncode))
    if done.returncode != 0:
        sys.exit(1)
    m = re.search(r"leaving ([0-9.]+) GiB to the allocator", text)
    cap = int(float(m.group(1)) * 2**30)
    runs = [run_example(64, 0, al) for al in ROWS]
    for al, row in ROWS.items():
        m = re.search(r"^%s +(\d+) " % re.escape(row), text, re.M)
        if m:
            largest = int(m.group(1))
            runs += [run_example(b, cap, al) for b in (largest, largest * 11 // 10)]
    for r in runs:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(cmd), "output": text, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
