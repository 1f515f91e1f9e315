"""Step time and peak reserved memory of torch.compile(mode="reduce-overhead")
under native PyTorch and under gpumem, one step at a time, in turns.

    python3 bench/torch/graphs_ab.py [--mode train|infer] [--steps N] [--warmup W] [--inner K] [--runs R]

Two worker processes (this file with --worker) build the same model with the
same seeds; the parent asks each for one step in turn (AB, BA, AB, ...), so
both see the same stretch of the host's speed. A timed step is K iterations
(--inner, default 20): one iteration of this small model takes well under a
millisecond, too short to time alone against the host's jitter. Prints one JSON line: the
medians of the timed steps, their ratio gpumem / native with a bootstrap
95% interval over the step pairs (and the geometric mean of the per-step
ratios with its interval, lockstep_ab.compare), and each side's peak
reserved memory (torch.cuda.max_memory_reserved).

--runs R repeats the comparison R times with fresh processes (one JSON line
each) and ends with a line of the runs' ratios, their geometric mean and a
95% interval that resamples runs (lockstep_ab.between_runs): a process
keeps some of its speed for its whole life, which no step-pair interval
sees.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def worker(args):
    sys.path.insert(0, os.path.join(REPO, "python"))
    if args.allocator == "gpumem":
        import gpumem.torch

        gpumem.torch.enable()
    import torch

    torch.manual_seed(0)
    d = 1024
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.LayerNorm(d)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(d, 16)).cuda()
    train = args.mode == "train"
    if not train:
        model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cm = torch.compile(model, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, d, device="cuda", generator=gen)
    y = torch.randint(0, 16, (256,), device="cuda", generator=gen)

    def step():
        if train:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(cm(x), y)
            loss.backward()
            opt.step()
            return loss
        with torch.no_grad():
            return cm(x).sum()

    for line in sys.stdin:
        if line.strip() == "step":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.inner):
                step()
            torch.cuda.synchronize()
            print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}), flush=True)
        else:
            print(json.dumps({"peak_reserved": torch.cuda.max_memory_reserved(),
                              "reserved": torch.cuda.memory_reserved()}), flush=True)
            return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--allocator", default="native")
    ap.add_argument("--mode", default="train")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--inner", type=int, default=20, help="iterations per timed step")
    ap.add_argument("--runs", type=int, default=1, help="comparisons, each with fresh processes")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    sys.path.insert(0, HERE)
    from lockstep_ab import between_runs

    ratios = [one_run(args)["ratio"] for _ in range(args.runs)]
    if args.runs > 1:
        print(json.dumps({"mode": args.mode, **between_runs(ratios)}), flush=True)


def one_run(args):
    """One comparison with fresh processes; prints and returns its line."""
    procs = {}
    for a in ("native", "gpumem"):
        procs[a] = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--allocator", a, "--mode", args.mode, "--inner", str(args.inner)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
    times = {"native": [], "gpumem": []}
    for k in range(args.warmup + args.steps):
        order = ("native", "gpumem") if k % 2 == 0 else ("gpumem", "native")
        for a in order:
            procs[a].stdin.write("step\n")
            procs[a].stdin.flush()
            ms = json.loads(procs[a].stdout.readline())["ms"]
            if k >= args.warmup:
                times[a].append(ms)
    mem = {}
    for a, p in procs.items():
        p.stdin.write("done\n")
        p.stdin.flush()
        mem[a] = json.loads(p.stdout.readline())
        p.wait(60)
    med = {a: statistics.median(t) for a, t in times.items()}
    from lockstep_ab import compare

    stats = compare(times["native"], times["gpumem"])
    line = {
        "mode": args.mode, "steps": args.steps,
        "median_ms": med, "ratio": med["gpumem"] / med["native"],
        "ratio_ci95": stats["ratio_of_medians_ci95"],
        "geo_mean_step_ratio": stats["geo_mean_step_ratio"], "step_ratio_ci95": stats["step_ratio_ci95"],
        "peak_reserved": {a: m["peak_reserved"] for a, m in mem.items()},
    }
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
