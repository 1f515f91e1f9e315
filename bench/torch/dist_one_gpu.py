"""FSDP2 and DDP jobs of bench/torch/fsdp_job.py run for real on one GPU
(torchrun, one rank, NCCL), their peak memory set beside what
`python -m gpumem.predict --gpus 1` predicts for them with no GPU:

    python bench/torch/dist_one_gpu.py measure OUT_DIR [--jobs NAME,...]   (on the GPU)
    python bench/torch/dist_one_gpu.py predict OUT_DIR [--jobs NAME,...] [--profile h100]   (anywhere; needs `make build`)
    python bench/torch/dist_one_gpu.py compare OUT_DIR

measure: each job in a torchrun of its own (--nproc-per-node 1), writing
OUT_DIR/measured/NAME.json (fsdp_job.py --report: peak reserved and
allocated, torch.cuda.max_memory_*); a job that fails leaves
OUT_DIR/measured/NAME.log. predict: the same jobs recorded on fake
tensors at batch 2 and 4 and predicted at the measured batch
(OUT_DIR/predicted/NAME.txt, the command's table). compare: one line a
job, measured against predicted peak reserved under PyTorch's allocator,
written to OUT_DIR/compare.txt too.

Jobs (Llama 3.2 1B's shape unless named mlp; batch x 2048 tokens):"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "fsdp_job.py")

# name: (fsdp_job.py arguments, batch per GPU measured and predicted at)
JOBS = {
    "fsdp2_mlp": (["--strategy", "fsdp2", "--model", "mlp"], 64),
    "ddp_mlp": (["--strategy", "ddp", "--model", "mlp"], 64),
    "fsdp2_llama1b_bf16": (["--strategy", "fsdp2", "--model", "llama-1b", "--seq-len", "2048", "--bf16"], 4),
    "fsdp2_llama1b_bf16_ckpt": (["--strategy", "fsdp2", "--model", "llama-1b", "--seq-len", "2048", "--bf16",
                                 "--checkpointing"], 8),
    "fsdp2_llama1b_offload": (["--strategy", "fsdp2", "--model", "llama-1b", "--seq-len", "2048", "--bf16",
                               "--cpu-offload"], 4),
    "ddp_llama1b_bf16": (["--strategy", "ddp", "--model", "llama-1b", "--seq-len", "2048", "--bf16"], 2),
}  # fmt: skip
__doc__ += "\n" + "\n".join("    %-26s %s, batch %d" % (k, " ".join(v[0]), v[1]) for k, v in JOBS.items()) + "\n"
GIB = 2**30


def jobs_of(text):
    names = list(JOBS) if not text else text.split(",")
    bad = [n for n in names if n not in JOBS]
    if bad:
        raise SystemExit("unknown job %s (jobs: %s)" % (", ".join(bad), ", ".join(JOBS)))
    return names


def measure(out, names, timeout):
    d = os.path.join(out, "measured")
    os.makedirs(d, mode=0o700, exist_ok=True)
    env = dict(os.environ, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
    for name in names:
        args, batch = JOBS[name]
        report = os.path.join(d, name + ".json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", JOB] + args
        cmd += ["--batch-size", str(batch), "--report", report]
        t0 = time.time()
        with open(os.path.join(d, name + ".log"), "w") as log:
            try:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timed out after %g s" % timeout
        peak = ": " + _peak(report) if rc == 0 else ""
        print("%-26s exit %s in %.0f s%s" % (name, rc, time.time() - t0, peak), flush=True)


def _peak(path):
    with open(path) as f:
        r = json.load(f)
    return "peak reserved %.3f GiB, allocated %.3f GiB" % (r["peak_reserved"] / GIB, r["peak_allocated"] / GIB)


def predict(out, names, timeout, profile="auto"):
    d = os.path.join(out, "predicted")
    os.makedirs(d, mode=0o700, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    for name in names:
        args, batch = JOBS[name]
        cmd = [sys.executable, "-m", "gpumem.predict", "--gpus", "1", "--memory", "80G", "--batch-sizes", "2,4",
               "--batch", str(batch), "--no-confirm", "--profile", profile, JOB] + args + ["--batch-size", "{B}"]  # fmt: skip
        t0 = time.time()
        try:
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
        except subprocess.TimeoutExpired:
            print("%-26s timed out after %g s" % (name, timeout), flush=True)
            continue
        with open(os.path.join(d, name + ".txt"), "wb") as f:
            f.write(done.stdout + done.stderr)
        print("%-26s exit %d in %.0f s" % (name, done.returncode, time.time() - t0), flush=True)


def predicted_peak(text, allocator="pytorch"):
    """The peak reserved (bytes) of an allocator's row in the command's table."""
    m = re.search(r"^\s+%s\s+\S+\s+([0-9.]+) GiB" % re.escape(allocator), text, re.M)
    return None if m is None else float(m.group(1)) * GIB


def compare(out):
    lines = ["%-26s %-6s %-16s %-16s %s" % ("job", "batch", "measured GiB", "predicted GiB", "predicted/measured")]
    for name, (args, batch) in JOBS.items():
        m = os.path.join(out, "measured", name + ".json")
        p = os.path.join(out, "predicted", name + ".txt")
        if not (os.path.exists(m) and os.path.exists(p)):
            continue
        with open(m) as f:
            measured = json.load(f)["peak_reserved"]
        with open(p) as f:
            pred = predicted_peak(f.read())
        ratio = "-" if not pred else "%.4f" % (pred / measured)
        lines.append("%-26s %-6d %-16.3f %-16s %s" % (name, batch, measured / GIB, "-" if pred is None else
                                                       "%.3f" % (pred / GIB), ratio))  # fmt: skip
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "compare.txt"), "w") as f:
        f.write(text)
    sys.stdout.write(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("measure", "predict", "compare"))
    ap.add_argument("out", help="the directory the results go to")
    ap.add_argument("--jobs", help="comma-separated job names (default: all)")
    ap.add_argument("--timeout", type=float, default=280, help="seconds a job may take (default 280)")
    ap.add_argument("--profile", default="auto",
                    help="predict: the device profile of the card the jobs were measured on (default auto)")
    a = ap.parse_args(argv)
    names = jobs_of(a.jobs)
    if a.phase == "measure":
        measure(a.out, names, a.timeout)
    elif a.phase == "predict":
        predict(a.out, names, a.timeout, a.profile)
    else:
        compare(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
