"""How right gpumem's prediction is, on a GPU: the jobs of
bench/torch/predict_jobs.py recorded at two small batch sizes, predicted at
larger ones, then run there under each allocator.

    python3 bench/torch/predict_accuracy.py OUTDIR [--jobs J,...] [--sizes 2,4] [--targets 16,64,256]
            [--fraction 0.1] [--parallel 10] [--pool-gib 125] [--deadline S] [--phases P,...]
            [--cpu-gpu-visible] [--device-total BYTES] [--measured RESULTS.json]

Phases (default all, in this order; each run's result is a file under
OUTDIR, and a run whose file is there already is not run again, so a
second run with the same OUTDIR carries on where the first stopped):

  record      each job at each of --sizes on the GPU, with PyTorch's
              allocation history on (python -m gpumem.predict._child gpu);
  cpu         the same on fake CUDA tensors under the CPU recorder and its
              device profile, with no GPU visible (CUDA_VISIBLE_DEVICES="";
              --cpu-gpu-visible: visible, unused; on a machine with no GPU,
              --phases cpu,predict with --device-total and --measured, a
              GPU run's results.json to set the predictions against);
  predict     `gpumem predict` from each pair of recordings: the peak reserved
              at each of --targets under each allocator, and the largest batch
              under a cap of --fraction of the device's memory;
  direct      the CPU recorder at each target itself, replayed with `gpumem
              fit`, and the largest batch under the cap searched with
              recordings at the batches, from the CPU prediction's (what
              `python -m gpumem.predict` checks on the CPU recorder,
              gpumem.predict.confirm);
  probe       the same on the GPU machine, each convolution also run for
              real on the GPU for its workspaces (gpumem.predict.probe),
              the search started from the GPU prediction's (what the
              command checks on a GPU machine);
  measure     each job at each target under native PyTorch, expandable
              segments and gpumem (torch.cuda.max_memory_reserved;
              --measure-allocators: only those, the others' figures taken
              from --measured);
  memtracker  PyTorch's MemTracker on each job at the middle target;
  cap         the largest batch that really fits under the cap
              (torch.cuda.set_per_process_memory_fraction), on a grid of
              ~10% steps: starting at the grid point at or below the
              prediction from the GPU recordings, up while it fits, down
              while it does not.

Runs share the GPU --parallel at a time, and at most --pool-gib of
predicted peaks at once (a run's peak is its own process's, so sharing the
GPU changes no figure). --deadline stops starting runs that many seconds
after the start. OUTDIR/summary.md gets the tables; OUTDIR/results.json
everything in them.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from predict_report import GRID, ROW, grid_floor, report  # noqa: E402
JOBS_SCRIPT = os.path.join(HERE, "predict_jobs.py")
GIB = 1 << 30
ALLOCATORS = ("native", "expandable", "gpumem")


def grid_index(b):
    return GRID.index(b)


class Pool:
    """At most `slots` runs at once and at most `gib` of their predicted
    peaks; stops granting after the deadline."""

    def __init__(self, slots, gib, deadline):
        self.slots, self.gib, self.deadline = slots, gib, deadline
        self.cond = threading.Condition()
        self.used_slots = 0
        self.used_gib = 0.0

    def acquire(self, gib):
        gib = min(gib, self.gib)
        with self.cond:
            while self.used_slots >= self.slots or self.used_gib + gib > self.gib:
                if time.time() > self.deadline:
                    return None
                self.cond.wait(1.0)
            if time.time() > self.deadline:
                return None
            self.used_slots += 1
            self.used_gib += gib
            return gib

    def release(self, gib):
        with self.cond:
            self.used_slots -= 1
            self.used_gib -= gib
            self.cond.notify_all()


class Runner:
    def __init__(self, out, pool, timeout):
        self.out, self.pool, self.timeout = out, pool, timeout
        os.makedirs(os.path.join(out, "runs"), exist_ok=True)
        self.log_lock = threading.Lock()

    def say(self, text):
        with self.log_lock:
            print(text, flush=True)
            with open(os.path.join(self.out, "progress.log"), "a") as f:
                f.write(text + "\n")

    def run(self, name, cmd, gib, env=None, result_file=None):
        """Runs cmd once (unless result_file exists); returns the parsed
        result file, or None (failed, skipped past the deadline)."""
        result_file = result_file or os.path.join(self.out, "runs", name + ".json")
        if os.path.exists(result_file):
            with open(result_file) as f:
                return json.load(f)
        held = self.pool.acquire(gib)
        if held is None:
            self.say("%s: not run (deadline)" % name)
            return None
        t0 = time.time()
        try:
            left = max(30, self.pool.deadline + 90 - time.time())
            with open(os.path.join(self.out, "runs", name + ".log"), "w") as log:
                try:
                    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        timeout=min(self.timeout, left)).returncode  # fmt: skip
                except subprocess.TimeoutExpired:
                    rc = "timeout"
        finally:
            self.pool.release(held)
        ok = rc == 0 and os.path.exists(result_file)
        self.say("%s: %s in %.0f s" % (name, "done" if ok else "FAILED (%s)" % rc, time.time() - t0))
        if not ok:
            return None
        with open(result_file) as f:
            return json.load(f)


def child_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def record(runner, job, batch, mode, steps):
    d = os.path.join(runner.out, "recordings", job, "%s_b%d" % (mode, batch))
    os.makedirs(d, exist_ok=True)
    cmd = [sys.executable, "-m", "gpumem.predict._child", mode, d, str(steps), "h200", JOBS_SCRIPT, job,
           "--batch-size", str(batch), "--steps", str(steps)]  # fmt: skip
    env = child_env({"CUDA_VISIBLE_DEVICES": ""} if mode == "cpu" and runner.hide_gpu else None)
    # (a probe run holds only one convolution's tensors on the GPU at a time)
    meta = runner.run("record_%s_%s_b%d" % (job, mode, batch), cmd, {"gpu": 8, "probe": 2}.get(mode, 0), env,
                      os.path.join(d, "meta.json"))  # fmt: skip
    return os.path.join(d, meta["file"]) if meta else None


def gpumem_predict(binary, sizes, traces, extra):
    cmd = [binary, "predict", "--sizes", ",".join(map(str, sizes))] + traces + extra + ["--json"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if done.returncode != 0:
        return {"error": done.stderr.decode("utf-8", "replace").strip()[-600:]}
    return json.loads(done.stdout)


def rows_of(doc):
    return {r["allocator"]: r for r in doc.get("allocators", [])}


def predict(binary, sizes, traces, targets, cap_bytes):
    """{"targets": {T: {allocator row: peak reserved}}, "largest": {row: batch}, "error": ...}"""
    out = {"targets": {}, "largest": {}}
    for t in targets:
        doc = gpumem_predict(binary, sizes, traces, ["--batch", str(t)])
        if "error" in doc:
            out["error"] = doc["error"]
            return out
        out["targets"][str(t)] = {a: r.get("peak_reserved_bytes") for a, r in rows_of(doc).items()}
        out["targets"][str(t)]["peak_live"] = doc.get("peak_live_bytes")
    doc = gpumem_predict(binary, sizes, traces, ["--memory", "%dB" % cap_bytes])
    if "error" in doc:
        out["error"] = doc["error"]
        return out
    out["largest"] = {a: r.get("largest_batch") for a, r in rows_of(doc).items()}
    return out


def direct(runner, binary, job, targets, cap_bytes, steps, start, budget=24, mode="cpu"):
    """The CPU recorder at the batches themselves (mode probe: with the
    convolutions run on the GPU): {"targets": {T: {allocator row: peak
    reserved}}, "largest": {row: batch}, "bounds": {row: (fits, does not)},
    "recordings": [batch, ...]}, or {"error": ...}."""
    from gpumem.predict import confirm

    def record_at(b):
        path = record(runner, job, b, mode, steps)
        if path is None:
            raise RuntimeError("the %s recording of %s at batch %d failed or was not run" % (mode, job, b))
        return path

    checker = confirm.Checker(record_at, cap_bytes, binary, budget)
    out = {"targets": {}, "largest": {}, "bounds": {}}
    try:
        for t in targets:
            out["targets"][str(t)] = checker.peaks(t)
        for a in ALLOCATORS:
            row = ROW[a]
            if not start.get(row):
                continue
            try:
                lo, hi = confirm.largest(lambda b: checker.fits(b, row), start[row], known=checker.known(row))
            except confirm.SearchBudget as e:
                lo, hi = e.lo, e.hi
            out["largest"][row] = lo
            out["bounds"][row] = (lo, hi)
    except (RuntimeError, confirm.SearchBudget) as e:
        out["error"] = str(e)
    out["recordings"] = sorted(checker.rows)
    return out


def measure(runner, job, batch, allocator, steps, gib, fraction=None):
    tag = "cap" if fraction is not None else "measure"
    name = "%s_%s_%s_b%d" % (tag, job, allocator, batch)
    res = os.path.join(runner.out, "runs", name + ".json")
    cmd = [sys.executable, JOBS_SCRIPT, job, "--batch-size", str(batch), "--steps", str(steps),
           "--allocator", allocator, "--json", res]  # fmt: skip
    if fraction is not None:
        cmd += ["--fraction", str(fraction)]
    return runner.run(name, cmd, gib, child_env(), res)


def memtracker(runner, job, batch, steps):
    name = "memtracker_%s_b%d" % (job, batch)
    res = os.path.join(runner.out, "runs", name + ".json")
    cmd = [sys.executable, JOBS_SCRIPT, job, "--batch-size", str(batch), "--steps", str(steps), "--memtracker",
           "--json", res]  # fmt: skip
    return runner.run(name, cmd, 0, child_env(), res)


def cap_chain(runner, job, allocator, start, steps, fraction, cap_gib, max_moves=5):
    """The largest grid batch that fits under the cap, walking from start:
    {"largest": B or None, "bound": "exact" | ">= B" | "< B", "runs": {batch: fits}}."""
    runs = {}

    def fits(b):
        r = measure(runner, job, b, allocator, steps, cap_gib, fraction)
        if r is None:
            return None
        runs[b] = not r["oom"]
        return runs[b]

    i = grid_index(start)
    f = fits(GRID[i])
    if f is None:
        return {"largest": None, "bound": "not run", "runs": runs}
    step = 1 if f else -1
    for _ in range(max_moves):
        j = i + step
        if j < 0:
            return {"largest": None, "bound": "batch 1 does not fit", "runs": runs}
        g = fits(GRID[j])
        if g is None:
            break
        if g != f:  # the boundary: the fitting side of it
            return {"largest": GRID[min(i, j)], "bound": "exact", "runs": runs}
        i = j
    return {"largest": GRID[i], "bound": (">=" if f else "<") + " %d" % GRID[i], "runs": runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--jobs", default=None, help="comma-separated (default: every job of predict_jobs.py)")
    ap.add_argument("--sizes", default="2,4")
    ap.add_argument("--targets", default="16,64,256")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--parallel", type=int, default=10)
    ap.add_argument("--pool-gib", type=float, default=125)
    ap.add_argument("--deadline", type=float, default=1e9)
    ap.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    ap.add_argument("--phases", default="record,cpu,predict,direct,probe,measure,memtracker,cap")
    ap.add_argument("--direct-from", choices=["cpu", "gpu"], default="cpu",
                    help="direct phase: start the search for the largest batch from the prediction of the CPU "
                         "recordings (default) or of the GPU ones")
    ap.add_argument("--measure-allocators", default=",".join(ALLOCATORS),
                    help="the allocators the measure phase runs (default all three)")
    ap.add_argument("--gpumem", default=os.path.join(REPO, "build", "gpumem"), help="the gpumem command")
    ap.add_argument("--cpu-gpu-visible", action="store_true",
                    help="cpu phase: leave the GPU visible (the recorder still uses none)")
    ap.add_argument("--measured", default=None,
                    help="a GPU run's results.json: its measured peaks, MemTracker figures and largest batches "
                         "are set beside this run's predictions (recordings made on a machine with no GPU)")
    ap.add_argument("--device-total", type=int, default=None,
                    help="the device's memory in bytes (default: asked of the GPU; give it to predict on a "
                         "machine with none, --phases cpu,predict)")
    args = ap.parse_args()

    import predict_jobs

    jobs = args.jobs.split(",") if args.jobs else list(predict_jobs.JOBS)
    sizes = [int(s) for s in args.sizes.split(",")]
    targets = [int(t) for t in args.targets.split(",")]
    phases = set(args.phases.split(","))
    os.makedirs(args.outdir, exist_ok=True)
    start = time.time()
    pool = Pool(args.parallel, args.pool_gib, start + args.deadline)
    runner = Runner(args.outdir, pool, args.timeout)
    runner.hide_gpu = not args.cpu_gpu_visible
    total = args.device_total or int(subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[1])"], stdout=subprocess.PIPE,
        check=True).stdout)  # fmt: skip
    cap_bytes = int(args.fraction * total)
    results_path = os.path.join(args.outdir, "results.json")
    results = {}
    if os.path.exists(results_path):
        with open(results_path) as f:
            results = json.load(f)
    results.update({"device_total": total, "fraction": args.fraction, "cap_bytes": cap_bytes, "sizes": sizes,
                    "targets": targets, "steps": args.steps, "grid": GRID[:80]})  # fmt: skip
    jr = results.setdefault("jobs", {})
    for j in jobs:
        jr.setdefault(j, {})
    if args.measured:
        with open(args.measured) as f:
            gpu_run = json.load(f)
        for j in jobs:
            for key in ("measured", "memtracker", "cap"):
                if key in gpu_run.get("jobs", {}).get(j, {}):
                    jr[j][key] = gpu_run["jobs"][j][key]
        results["measured_from"] = args.measured

    def parallel(fn, items):
        threads = [threading.Thread(target=fn, args=it) for it in items]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # recordings
    traces = {j: {} for j in jobs}

    def rec(j, mode):
        paths = [record(runner, j, b, mode, args.steps) for b in sizes]
        if all(paths):
            traces[j][mode] = paths

    modes = (["gpu"] if "record" in phases else []) + (["cpu"] if "cpu" in phases else [])
    for j in jobs:  # already recorded (an earlier run), whatever the phases
        for mode in ("gpu", "cpu"):
            ds = [os.path.join(args.outdir, "recordings", j, "%s_b%d" % (mode, b)) for b in sizes]
            if all(os.path.exists(os.path.join(d, "meta.json")) for d in ds):
                traces[j][mode] = [os.path.join(d, "trace") for d in ds]
    parallel(rec, [(j, m) for j in jobs for m in modes if m not in traces[j]])

    # predictions (cheap: the gpumem command on the recordings)
    if "predict" in phases:
        for j in jobs:
            for mode, paths in traces[j].items():
                jr[j]["predicted_" + mode] = predict(args.gpumem, sizes, paths, targets, cap_bytes)
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)

    # the recorder at the batches themselves: on the CPU (direct), on the GPU machine with its
    # convolutions run there (probe); each search starts from one prediction of the scaled runs
    checks = [(phase, mode, start_from) for phase, mode, start_from in
              (("direct", "cpu", args.direct_from), ("probe", "probe", "gpu")) if phase in phases]  # fmt: skip
    if checks:
        sys.path.insert(0, os.path.join(REPO, "python"))
    for phase, mode, start_from in checks:
        def run_check(j, phase=phase, mode=mode, start_from=start_from):
            start = jr[j].get("predicted_" + start_from, {}).get("largest") or {}
            jr[j]["predicted_" + phase] = direct(runner, args.gpumem, j, targets, cap_bytes, args.steps, start,
                                                 mode=mode)  # fmt: skip

        parallel(run_check, [(j,) for j in jobs])
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)

    def predicted_gib(j, t):
        for mode in ("gpu", "cpu"):
            p = jr[j].get("predicted_" + mode, {}).get("targets", {}).get(str(t), {})
            if p.get("pytorch"):
                return p["pytorch"] / GIB * 1.1 + 1
        return None

    work = []
    if "measure" in phases:
        for t in targets:
            for j in jobs:
                for a in args.measure_allocators.split(","):
                    gib = predicted_gib(j, t)
                    if gib is None or gib > args.pool_gib:
                        jr[j].setdefault("measured", {}).setdefault(str(t), {})[a] = {
                            "skipped": "no prediction" if gib is None else "predicted %.0f GiB" % gib}
                        continue
                    work.append(("measure", j, t, a, gib))
    if "memtracker" in phases:
        mid = targets[len(targets) // 2]
        for j in jobs:
            work.append(("memtracker", j, mid, None, 0))
    if "cap" in phases:
        for j in jobs:
            largest = jr[j].get("predicted_gpu", {}).get("largest") or jr[j].get("predicted_cpu", {}).get("largest")
            for a in ALLOCATORS:
                b = grid_floor((largest or {}).get(ROW[a]))
                if b is not None:
                    work.append(("cap", j, b, a, cap_bytes / GIB + 1))

    def do(kind, j, t, a, gib):
        if kind == "measure":
            r = measure(runner, j, t, a, args.steps, gib)
            jr[j].setdefault("measured", {}).setdefault(str(t), {})[a] = r
        elif kind == "memtracker":
            jr[j]["memtracker"] = memtracker(runner, j, t, args.steps)
        else:
            jr[j].setdefault("cap", {})[a] = cap_chain(runner, j, a, t, args.steps, args.fraction, gib)

    # the first gpumem run compiles its PyTorch shim: once, before the rest
    if any(w[3] == "gpumem" for w in work):
        subprocess.run([sys.executable, "-c", "import gpumem.torch; gpumem.torch.enable(); import torch; "
                        "torch.empty(1, device='cuda')"], env=child_env())  # fmt: skip
    parallel(do, work)
    results["elapsed_s"] = round(time.time() - start)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.outdir, "summary.md"), "w") as f:
        f.write(report(results))
    print(open(os.path.join(args.outdir, "summary.md")).read())


if __name__ == "__main__":
    main()
