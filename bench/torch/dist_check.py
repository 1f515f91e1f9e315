"""Jobs of bench/torch/fsdp_job.py (DDP, FSDP2) run for real under torchrun
on N GPUs of one host, each rank's peak memory set beside what
`python -m gpumem.predict --gpus N` said for it beforehand:

    python bench/torch/dist_check.py measure OUT [--nproc N] [--jobs ...] [--allocators ...]   (N GPUs)
    python bench/torch/dist_check.py record OUT [--nproc N] [--jobs ...]                       (N GPUs)
    python bench/torch/dist_check.py cap OUT --fraction F [--nproc N] [--jobs ...]             (N GPUs)
    python bench/torch/dist_check.py predict OUT [--nproc N] [--profile P] [--fraction F]     (anywhere)
    python bench/torch/dist_check.py compare OUT [--nproc N]

measure: each job at each of its batch sizes per GPU under each allocator
(native, expandable segments, gpumem: `torchrun -m gpumem.torch`, the script
unedited), one torchrun a run, NCCL; OUT/measured/NAME_bB_ALLOC.json for
rank 0 and .rankR.json for the others (fsdp_job.py --report: peak reserved
and allocated, torch.cuda.max_memory_*). record: the small GPU runs' route,
each rank recorded by gpumem (`record:` of GPUMEM_CONF) at batch 1 and 2,
then `gpumem predict` on each rank's two recordings at the job's batch sizes
(OUT/recorded/). cap: the largest batch per GPU that fits under
set_per_process_memory_fraction(F) (fsdp_job.py --memory-fraction), found on a
grid of about 10% steps from the prediction's answer, up while runs fit and
down while they do not; a run that ends in anything but an out-of-memory
error stops the walk (OUT/cap/NAME_ALLOC.json, each run in OUT/cap/runs/). predict: the CPU recorder (`--gpus N` with the
command's default flags unless --batch-sizes or --no-confirm) at each batch, and with
--fraction the same under the cap (the job then calls
set_per_process_memory_fraction itself, which the prediction honours).
compare: one line a job, batch and allocator (each rank's measured peak
reserved against the predictions, and the bracket the cap walk found against
the predicted largest batch), written to OUT/compare.txt too.

--memory is the card's memory for predict (default 80G; with --fraction give
the card's whole memory as PyTorch counts it, torch.cuda.mem_get_info()[1]).

Jobs (batch x 2048 tokens for the Llama, x 512 for BERT):"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "fsdp_job.py")
sys.path.insert(0, HERE)
from predict_report import GRID, grid_floor  # noqa: E402  (one grid of ~10% steps for every cap walk)

sys.path.insert(0, os.path.join(REPO, "python"))
from gpumem._safefs import private_dir, write_file  # noqa: E402  (results written as src/outfile.c writes)

LLAMA_1B = ["--model", "llama-1b", "--seq-len", "2048", "--bf16"]
# name: (fsdp_job.py arguments, batch sizes per GPU measured and predicted at)
JOBS = {
    "fsdp2_mlp": (["--strategy", "fsdp2", "--model", "mlp"], [64]),
    "ddp_mlp": (["--strategy", "ddp", "--model", "mlp"], [64]),
    "fsdp2_llama1b_bf16": (["--strategy", "fsdp2"] + LLAMA_1B, [4, 6]),
    "fsdp2_llama1b_bf16_ckpt": (["--strategy", "fsdp2"] + LLAMA_1B + ["--checkpointing"], [8, 12]),
    "fsdp2_llama1b_offload": (["--strategy", "fsdp2"] + LLAMA_1B + ["--cpu-offload"], [4]),
    "ddp_llama1b_bf16": (["--strategy", "ddp"] + LLAMA_1B, [2]),
    "ddp_bert_base": (["--strategy", "ddp", "--model", "bert-base", "--seq-len", "512", "--bf16"], [32, 64]),
}  # fmt: skip
__doc__ += "\n" + "\n".join("    %-26s %s, batch %s" % (k, " ".join(v[0]), ",".join(map(str, v[1])))
                            for k, v in JOBS.items()) + "\n"  # fmt: skip
ALLOCATORS = ("native", "expandable", "gpumem")
PREDICTED_ROW = {"native": "pytorch", "expandable": "pytorch expandable", "gpumem": "gpumem default"}
GIB = 2**30


def names_of(text, known, what):
    """The comma-separated names of text (all of known where empty), each
    one of known, else a SystemExit that names the bad ones."""
    names = list(known) if not text else text.split(",")
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit("unknown %s %s (%ss: %s)" % (what, ", ".join(bad), what, ", ".join(known)))
    return names


def run_env(allocator, conf=None):
    env = dict(os.environ)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GPUMEM_CONF"):
        env.pop(key, None)  # each run gets only its own allocator
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if conf:
        env["GPUMEM_CONF"] = conf
    # this checkout's package for -m gpumem.torch (it finds build/libgpumem.so, or GPUMEM_LIBRARY)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, as everywhere in bench/torch
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def torchrun(nproc, allocator, args, log_path, timeout, conf=None):
    """Runs fsdp_job.py under torchrun; returns its exit status, "timeout", or
    "oom" when it ended in an out-of-memory error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if allocator == "gpumem":
        cmd += ["-m", "gpumem.torch"]
    cmd += [JOB] + args
    try:
        done = subprocess.run(cmd, env=run_env(allocator, conf), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        write_file(log_path, ("# %s\n" % " ".join(cmd)).encode() + (e.stdout or b""))
        return "timeout"
    write_file(log_path, ("# %s\n" % " ".join(cmd)).encode() + done.stdout)
    if done.returncode != 0 and re.search(rb"OutOfMemoryError|CUDA out of memory", done.stdout):
        return "oom"
    return done.returncode


def rank_reports(path, nproc):
    """[report of rank 0, 1, ...] (None where missing)."""
    out = []
    for r in range(nproc):
        p = path if r == 0 else "%s.rank%d.json" % (path, r)
        try:
            with open(p) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            out.append(None)
    return out


def measure(out, names, allocators, nproc, timeout):
    d = os.path.join(out, "measured")
    private_dir(d)
    for name in names:
        args, batches = JOBS[name]
        for b in batches:
            for al in allocators:
                base = os.path.join(d, "%s_b%d_%s" % (name, b, al))
                t0 = time.time()
                rc = torchrun(nproc, al, args + ["--batch-size", str(b), "--report", base + ".json"], base + ".log",
                              timeout)  # fmt: skip
                peaks = ""
                if rc == 0:
                    peaks = ": peak reserved " + ", ".join(
                        "-" if r is None else "%.3f" % (r["peak_reserved"] / GIB) for r in rank_reports(base + ".json", nproc)
                    ) + " GiB by rank"  # fmt: skip
                print("%-26s batch %-4d %-10s exit %s in %.0f s%s" % (name, b, al, rc, time.time() - t0, peaks),
                      flush=True)  # fmt: skip


def record(out, names, nproc, timeout, gpumem_bin, memory):
    """The small GPU runs' route: gpumem's recording of each rank at 1 and 2,
    then `gpumem predict` per rank at each of the job's batches."""
    d = os.path.join(out, "recorded")
    private_dir(d)
    for name in names:
        args, batches = JOBS[name]
        traces = {}  # rank: [trace at 1, trace at 2]
        for b in (1, 2):
            base = os.path.join(d, "%s_b%d" % (name, b))
            for old in glob.glob(base + ".pid*.trace.gz"):
                os.unlink(old)
            conf = "record:%s.pid%%p.trace.gz" % base
            rc = torchrun(nproc, "gpumem", args + ["--batch-size", str(b), "--report", base + ".json"], base + ".log",
                          timeout, conf)  # fmt: skip
            print("%-26s recorded at batch %d: exit %s" % (name, b, rc), flush=True)
            for r, rep in enumerate(rank_reports(base + ".json", nproc)):
                path = "%s.pid%d.trace.gz" % (base, rep["pid"]) if rep else None
                traces.setdefault(r, []).append(path if path and os.path.exists(path) else None)
        for r, paths in sorted(traces.items()):
            if None in paths:
                print("%-26s rank %d: a recording is missing" % (name, r), flush=True)
                continue
            for b in batches:
                done = subprocess.run([gpumem_bin, "predict", "--batch-sizes", "1,2"] + paths
                                      + ["--batch", str(b), "--memory", memory, "--json"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
                write_file(os.path.join(d, "%s_b%d.rank%d.json" % (name, b, r)),
                           done.stdout if done.returncode == 0 else done.stderr)
                print("%-26s rank %d at %d: gpumem predict exit %d" % (name, r, b, done.returncode), flush=True)


def predict(out, names, nproc, timeout, profile, memory, fraction=None, extra=()):
    d = os.path.join(out, "predicted")
    private_dir(d)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    for name in names:
        args, batches = JOBS[name]
        runs = [("%s_b%d" % (name, b), ["--batch", str(b)], []) for b in batches]
        if fraction is not None:
            runs.append(("%s_cap" % name, [], ["--memory-fraction", str(fraction)]))
        for tag, flags, job_flags in runs:
            cmd = [sys.executable, "-m", "gpumem.predict", "--gpus", str(nproc), "--memory", memory,
                   "--profile", profile] + list(extra) + flags + [JOB] + args + job_flags + ["--batch-size", "{B}"]  # fmt: skip
            t0 = time.time()
            try:
                done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
            except subprocess.TimeoutExpired:
                print("%-30s timed out after %g s" % (tag, timeout), flush=True)
                continue
            write_file(os.path.join(d, tag + ".txt"), done.stdout + done.stderr)
            print("%-30s exit %d in %.0f s" % (tag, done.returncode, time.time() - t0), flush=True)


def predicted_row(text, allocator):
    """(largest batch per GPU, peak reserved bytes or None) of an allocator's
    row in a --gpus table (the first world size's), or None."""
    m = re.search(r"^\s+%s\s+(\d+)\S*(?: \(rank \d+\))?\s+(?:([0-9.]+) GiB|-)" % re.escape(allocator), text, re.M)
    if m is None:
        return None
    return int(m.group(1)), None if m.group(2) is None else float(m.group(2)) * GIB


def cap(out, names, allocators, nproc, fraction, timeout, max_moves=4):
    d = os.path.join(out, "cap")
    private_dir(d)
    private_dir(os.path.join(d, "runs"))
    for name in names:
        args, _ = JOBS[name]
        try:
            with open(os.path.join(out, "predicted", name + "_cap.txt")) as f:
                text = f.read()
        except OSError:
            print("%-26s no prediction under the cap (run predict with --fraction first)" % name, flush=True)
            continue
        for al in allocators:
            row = predicted_row(text, PREDICTED_ROW[al])
            if row is None:
                print("%-26s %-10s no predicted largest batch" % (name, al), flush=True)
                continue
            runs = {}

            def fits(b):
                base = os.path.join(d, "runs", "%s_%s_b%d" % (name, al, b))
                rc = torchrun(nproc, al, args + ["--batch-size", str(b), "--memory-fraction", str(fraction), "--report",
                                                 base + ".json"], base + ".log", timeout)  # fmt: skip
                runs[b] = "fits" if rc == 0 else "oom" if rc == "oom" else "error %s" % rc
                return runs[b]

            i = GRID.index(grid_floor(row[0]) or GRID[0])
            first = fits(GRID[i])
            step = 1 if first == "fits" else -1
            found = None
            if first in ("fits", "oom"):
                for _ in range(max_moves):
                    j = i + step
                    if j < 0 or j >= len(GRID):
                        break
                    got = fits(GRID[j])
                    if got not in ("fits", "oom"):
                        break
                    if got != first:
                        found = GRID[min(i, j)]
                        break
                    i = j
            res = {"predicted": row[0], "largest": found, "runs": runs, "fraction": fraction}
            write_file(os.path.join(d, "%s_%s.json" % (name, al)), json.dumps(res, indent=1))
            print("%-26s %-10s predicted %d, runs %s" % (name, al, row[0], ", ".join(
                "%d %s" % kv for kv in sorted(runs.items()))), flush=True)  # fmt: skip


def compare(out, nproc):
    head = "%-26s %-5s %-10s %-26s %-16s %-10s %-16s %s" % (
        "job", "batch", "allocator", "measured GiB by rank", "CPU recorder", "ratio", "small GPU runs", "ratio")
    lines = [head]
    for name, (args, batches) in JOBS.items():
        for b in batches:
            for al in ALLOCATORS:
                reps = rank_reports(os.path.join(out, "measured", "%s_b%d_%s.json" % (name, b, al)), nproc)
                if not any(reps):
                    continue
                measured = [r["peak_reserved"] if r else None for r in reps]
                worst = max(m for m in measured if m is not None)
                cells = []
                p = os.path.join(out, "predicted", "%s_b%d.txt" % (name, b))
                row = predicted_row(open(p).read(), PREDICTED_ROW[al]) if os.path.exists(p) else None
                pred = row[1] if row else None
                cells += ["-" if pred is None else "%.3f" % (pred / GIB), "-" if pred is None else "%+.2f%%" % (
                    100 * (pred / worst - 1))]  # fmt: skip
                rec = []
                for r in range(nproc):
                    p = os.path.join(out, "recorded", "%s_b%d.rank%d.json" % (name, b, r))
                    try:
                        with open(p) as f:
                            rows = {x["allocator"]: x for x in json.load(f)["allocators"]}
                        rec.append(rows[PREDICTED_ROW[al]]["peak_reserved_bytes"])
                    except (OSError, ValueError, KeyError):
                        rec.append(None)
                got = [x for x in rec if x is not None]
                cells += ["-" if not got else "%.3f" % (max(got) / GIB), "-" if not got else "%+.2f%%" % (
                    100 * (max(got) / worst - 1))]  # fmt: skip
                lines.append("%-26s %-5d %-10s %-26s %-16s %-10s %-16s %s" % (
                    name, b, al, " / ".join("-" if m is None else "%.3f" % (m / GIB) for m in measured), *cells))
    caps = sorted(glob.glob(os.path.join(out, "cap", "*.json")))
    if caps:
        lines += ["", "%-36s %-10s %-16s %s" % ("job and allocator (cap)", "predicted", "largest that fit", "runs")]
        for p in caps:
            with open(p) as f:
                r = json.load(f)
            within = ""
            if r["largest"]:
                k = abs(GRID.index(grid_floor(r["predicted"]) or GRID[0]) - GRID.index(r["largest"]))
                within = " (%d grid step%s apart)" % (k, "" if k == 1 else "s")
            lines.append("%-36s %-10d %-16s %s%s" % (os.path.basename(p)[:-5], r["predicted"], r["largest"] or "-",
                                                     ", ".join("%s %s" % kv for kv in sorted(r["runs"].items(),
                                                               key=lambda kv: int(kv[0]))), within))  # fmt: skip
    text = "\n".join(lines) + "\n"
    write_file(os.path.join(out, "compare.txt"), text)
    sys.stdout.write(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("measure", "record", "cap", "predict", "compare"))
    ap.add_argument("out", help="the directory the results go to")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) a job runs on (default 1)")
    ap.add_argument("--jobs", help="comma-separated job names (default: all)")
    ap.add_argument("--allocators", help="measure, cap: comma-separated, of native,expandable,gpumem (default all)")
    ap.add_argument("--timeout", type=float, default=280, help="seconds a run may take (default 280)")
    ap.add_argument("--profile", default="auto",
                    help="predict: the device profile of the card the jobs run on (default auto)")
    ap.add_argument("--memory", default="80G", help="predict, record: the card's memory (default 80G)")
    ap.add_argument("--fraction", type=float, help="cap (and predict): set_per_process_memory_fraction's share")
    ap.add_argument("--batch-sizes", help="predict: the batch sizes to record at (default: the command's, 1,2)")
    ap.add_argument("--no-confirm", action="store_true", help="predict: skip the check at the batches themselves")
    ap.add_argument("--gpumem", default=os.path.join(REPO, "build", "gpumem"), help="record: the gpumem program")
    a = ap.parse_args(argv)
    if a.nproc < 1:
        ap.error("--nproc must be at least 1")
    if a.fraction is not None and not 0 < a.fraction <= 1:
        ap.error("--fraction must be in (0, 1]")
    if a.phase == "cap" and a.fraction is None:
        ap.error("cap needs --fraction")
    names = names_of(a.jobs, JOBS, "job")
    if a.phase == "measure":
        measure(a.out, names, names_of(a.allocators, ALLOCATORS, "allocator"), a.nproc, a.timeout)
    elif a.phase == "record":
        record(a.out, names, a.nproc, a.timeout, a.gpumem, a.memory)
    elif a.phase == "cap":
        cap(a.out, names, names_of(a.allocators, ALLOCATORS, "allocator"), a.nproc, a.fraction, a.timeout)
    elif a.phase == "predict":
        extra = (["--batch-sizes", a.batch_sizes] if a.batch_sizes else []) + (["--no-confirm"] if a.no_confirm else [])
        predict(a.out, names, a.nproc, a.timeout, a.profile, a.memory, a.fraction, extra)
    else:
        compare(a.out, a.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
