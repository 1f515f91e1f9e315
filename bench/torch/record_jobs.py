"""Records a workload's allocation sequence under PyTorch's own allocator and
measures its peak reserved memory under PyTorch's allocators, for the
memory comparison of traces/jobs/ (traces/jobs/README.md).

    python3 bench/torch/record_jobs.py WORKLOAD OUTDIR --mode record|native|expandable|async [--steps N]

record: PyTorch's caching allocator with its history on (context off, so
        the only cost is the ring of events); writes OUTDIR/WORKLOAD.trace.gz
        (traces/README.md's format, a "# step N" line after each step, the
        allocation events of PyTorch's snapshot: alloc and free_requested)
        and OUTDIR/WORKLOAD.record.json.
native, expandable, async: the same steps without history under each of
        PyTorch's allocators; writes OUTDIR/WORKLOAD.MODE.json.

Every JSON file holds the device, the torch version, the steps run, peak
allocated and peak reserved bytes (torch.cuda.max_memory_*) and
num_alloc_retries (a retry means the allocator freed cached segments to
make room, which a trace replay without a limit does not do).
"""

import argparse
import gzip
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STEPS = {
    "gpt2_generate": 2,
    "gpt2_beam_serve": 4,
    "llama_generate_serve": 8,
    "bert_varlen_train": 10,
    "lora_peft_ckpt": 6,
    "graphsage_varlen": 10,
    "resnet_multiscale": 8,
    "llama_finetune_varlen": 6,
    "distill_side_stream": 8,
    "decode_gpt2_b1": 2,
    "decode_gpt2m_b8": 2,
    "decode_gpt2l_b2": 2,
    "decode_gpt2_b32_long": 2,
    "decode_llama_b16": 2,
}
MAX_ENTRIES = 20_000_000


def write_trace(path, workload, torch, entries, step_ends):
    """The snapshot's events as trace lines: each allocation a dense ID,
    each free_requested a free; a "# step N" line where step N ended."""
    ids, sizes, lines = {}, {}, []
    nxt = live = peak = 0
    marks = list(step_ends)
    step = 0
    for k, e in enumerate(entries):
        while marks and k >= marks[0]:
            marks.pop(0)
            step += 1
            lines.append("# step %d" % step)
        a = e["action"]
        if a == "alloc":
            ids[e["addr"]] = nxt
            sizes[nxt] = e["size"]
            lines.append("a %d %d %d" % (nxt, e["size"], e["stream"]))
            live += e["size"]
            peak = max(peak, live)
            nxt += 1
        elif a == "free_requested":
            i = ids.pop(e["addr"], None)
            if i is None:  # allocated before the history started
                continue
            lines.append("f %d" % i)
            live -= sizes.pop(i)
    while marks:
        marks.pop(0)
        step += 1
        lines.append("# step %d" % step)
    header = [
        "# gpumem-trace v1",
        "# workload %s" % workload,
        "# source torch %s on %s, native caching allocator, history recorded" % (
            torch.__version__, torch.cuda.get_device_name()),
        "# lines: 'a ID SIZE STREAM' = allocate SIZE bytes on STREAM; 'f ID' = free",
    ]
    with gzip.open(path, "wt", compresslevel=9) as f:
        f.write("\n".join(header + lines) + "\n")
    return nxt, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("outdir")
    ap.add_argument("--mode", choices=["record", "native", "expandable", "async"], default="record")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()

    import workloads

    if args.workload not in workloads.WORKLOADS:
        ap.error("unknown workload %r (bench/torch/workloads.py has: %s)" % (
            args.workload, ", ".join(sorted(workloads.WORKLOADS))))
    steps = args.steps or STEPS.get(args.workload, 6)
    conf = {"expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}.get(args.mode)
    if conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    torch.cuda.init()
    if args.mode == "record":
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=MAX_ENTRIES)
    wargs = argparse.Namespace(steps=steps, warmup=0, allocator="native", conf=None, limit=None)
    t0 = time.perf_counter()
    model, make_state, step = workloads.WORKLOADS[args.workload](torch, wargs)
    state = make_state()
    step_ends, times = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = step(state, i)
        loss.item()
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - t) * 1e3, 1))
        del loss
        if args.mode == "record":
            step_ends.append(len(torch.cuda.memory._snapshot()["device_traces"][0]))
    stats = torch.cuda.memory_stats()
    result = {
        "workload": args.workload,
        "mode": args.mode,
        "conf": conf,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steps": steps,
        "step_ms": times,
        "wall_s": round(time.perf_counter() - t0, 1),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "num_alloc_retries": stats.get("num_alloc_retries"),
    }
    os.makedirs(args.outdir, exist_ok=True)
    if args.mode == "record":
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        entries = snap["device_traces"][0]
        result["entries"] = len(entries)
        result["entries_dropped"] = len(entries) >= MAX_ENTRIES
        allocs, peak_live = write_trace(os.path.join(args.outdir, args.workload + ".trace.gz"), args.workload,
                                        torch, entries, step_ends)
        result["allocations"] = allocs
        result["trace_peak_live"] = peak_live
    with open(os.path.join(args.outdir, "%s.%s.json" % (args.workload, args.mode)), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("workload", "mode", "peak_allocated", "peak_reserved",
                                             "num_alloc_retries", "wall_s")}), flush=True)


if __name__ == "__main__":
    main()
