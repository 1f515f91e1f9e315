"""Workloads for test_graphs.py, one per process (enable() must come first).

    python3 graphs_child.py WORKLOAD --allocator native|gpumem

The last line printed is one JSON object with the results.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(REPO, "python"))


def emit(**r):
    print(json.dumps(r), flush=True)


def setup(args):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.allocator == "gpumem":
        import gpumem.torch

        print("gpumem:", gpumem.torch.enable(), file=sys.stderr)
    import torch

    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    return torch


def mlp(torch):
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)
    ).cuda()


def stats(torch):
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def w_graph(torch, args):
    model = mlp(torch).eval()
    static_in = torch.randn(64, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.empty_cache()
    before = stats(torch)
    g = torch.cuda.CUDAGraph()
    # (captured on the warm-up stream, whose cuBLAS workspace exists already:
    # a new one would be made in the graph's pool and stay there)
    with torch.cuda.graph(g, stream=s), torch.no_grad():
        static_out = model(static_in)
    sums = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(20):
        static_in.copy_(torch.randn(64, 256, device="cuda", generator=gen))
        g.replay()
        sums.append(float(static_out.double().sum()))
    during = stats(torch)
    del g, static_out
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    after = stats(torch)
    emit(sums=sums, before=before, during=during, after=after)


def w_graphed_callables(torch, args):
    model = mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 256, device="cuda", requires_grad=True)
    model = torch.cuda.make_graphed_callables(model, (x,))
    gen = torch.Generator(device="cuda").manual_seed(2)
    losses = []
    for _ in range(20):
        inp = torch.randn(32, 256, device="cuda", generator=gen)
        tgt = torch.randint(0, 10, (32,), device="cuda", generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(inp), tgt)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    emit(losses=losses)


def w_compile(torch, args):
    train = args.mode == "train"
    model = mlp(torch)
    if not train:
        model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cm = torch.compile(model, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(3)
    out = []
    for _ in range(12):
        inp = torch.randn(64, 256, device="cuda", generator=gen)
        if train:
            tgt = torch.randint(0, 10, (64,), device="cuda", generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(cm(inp), tgt)
            loss.backward()
            opt.step()
            out.append(float(loss))
        else:
            with torch.no_grad():
                out.append(float(cm(inp).double().sum()))
    emit(values=out, peak_reserved=torch.cuda.max_memory_reserved())


def w_cudnn(torch, args):
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = True
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3, padding=1)
    ).cuda()
    gen = torch.Generator(device="cuda").manual_seed(4)
    sums = []
    for _ in range(5):
        x = torch.randn(16, 3, 64, 64, device="cuda", generator=gen)
        sums.append(float(net(x).double().sum()))
    emit(sums=sums, benchmark=bool(torch.backends.cudnn.benchmark))


def w_mempool(torch, args):
    torch.cuda.empty_cache()
    before = stats(torch)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        b = a * 2
    c = torch.ones(1 << 20, device="cuda")  # outside the pool
    total = float((b + c).double().sum())
    use = pool.use_count()
    during = stats(torch)
    del a, b, c, pool
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    emit(total=total, use_count=use, before=before, during=during, after=stats(torch))


def _segments(torch):
    torch.cuda.synchronize()
    return torch.cuda.memory_stats().get("segment.all.current", 0)


def w_mempool_no_split(torch, args):
    """MemPool(no_split=True): each allocation in the pool is a segment of
    its own, and a freed one comes back whole (same address)."""
    torch.cuda.empty_cache()
    pool = torch.cuda.MemPool(no_split=True)
    seg0 = _segments(torch)
    sizes = [128, 3 << 18, 3 << 18, 3 << 20]  # float32 elements: 512 B, 3 MiB, 3 MiB, 12 MiB
    with torch.cuda.use_mem_pool(pool):
        ts = [torch.full((n,), float(i + 1), device="cuda") for i, n in enumerate(sizes)]
    made = _segments(torch) - seg0
    ptr = ts[1].data_ptr()
    total = float(sum(t.double().sum() for t in ts))
    del ts[1]
    with torch.cuda.use_mem_pool(pool):
        again = torch.empty((1 << 18) + 1024, device="cuda")
    reused = again.data_ptr() == ptr
    del ts, again, pool
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    emit(segments_made=made, allocations=len(sizes), reused_whole=reused, total=total)


def w_mempool_allocator(torch, args):
    """MemPool(allocator=...): the pool's segments come from that allocator
    (pool_allocator.cu through CUDAPluggableAllocator), blocks inside them
    cached and split; everything goes back to it once the pool is gone."""
    import ctypes
    import gc

    lib = ctypes.CDLL(args.lib)
    lib.pool_test_count.restype = ctypes.c_long
    lib.pool_test_owns.argtypes = (ctypes.c_uint64, ctypes.c_size_t)
    lib.pool_test_segment_size.restype = ctypes.c_size_t
    alloc = torch.cuda.memory.CUDAPluggableAllocator(args.lib, "pool_test_malloc", "pool_test_free")
    torch.cuda.empty_cache()
    reserved0 = stats(torch)["reserved"]
    pool = torch.cuda.MemPool(alloc.allocator())
    sizes = [128, 3 << 18, 3 << 18, 3 << 20]  # float32 elements: 512 B, 3 MiB, 3 MiB, 12 MiB
    with torch.cuda.use_mem_pool(pool):
        ts = [torch.full((n,), float(i + 1), device="cuda") for i, n in enumerate(sizes)]
    pool_reserved = stats(torch)["reserved"] - reserved0
    inside = [bool(lib.pool_test_owns(t.data_ptr(), t.numel() * 4)) for t in ts]
    outside_t = torch.ones(1 << 10, device="cuda")  # not in the pool: not from its allocator
    outside = not lib.pool_test_owns(outside_t.data_ptr(), 4096)
    total = float(sum(t.double().sum() for t in ts))
    segments = []
    while lib.pool_test_segment_size(len(segments)):
        segments.append(int(lib.pool_test_segment_size(len(segments))))
    mallocs = int(lib.pool_test_count(0))
    del ts, outside_t, pool
    gc.collect()
    torch.cuda.empty_cache()
    emit(inside=inside, outside=outside, total=total, pool_reserved=pool_reserved, segments=sorted(segments),
         mallocs=mallocs, frees=int(lib.pool_test_count(1)), live_after=int(lib.pool_test_count(2)))


def w_mempool_use_on_oom(torch, args):
    """MemPool(use_on_oom=True): under a per-process cap, a request outside
    the pool that cannot get memory takes the pool's cached block; without
    the option it runs out of memory."""
    mib = 1 << 20
    result = {}
    for use_on_oom in (True, False):
        torch.cuda.empty_cache()
        pool = torch.cuda.MemPool(use_on_oom=use_on_oom)
        with torch.cuda.use_mem_pool(pool):
            t = torch.empty(256 * mib, dtype=torch.uint8, device="cuda")
        lo, hi = t.data_ptr(), t.data_ptr() + 256 * mib
        del t  # cached by the pool
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(0).total_memory
        cap = torch.cuda.memory_reserved() + 64 * mib
        torch.cuda.set_per_process_memory_fraction(cap / total)
        key = "with" if use_on_oom else "without"
        try:
            x = torch.empty(128 * mib, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError as e:
            x = None
            result[key] = {"ok": False, "message": str(e)[:300]}
        # (the cap off again before anything else allocates)
        torch.cuda.set_per_process_memory_fraction(1.0)
        if x is not None:
            x.fill_(1)
            result[key] = {"ok": True, "in_pool_block": lo <= x.data_ptr() < hi, "sum": int(x.sum())}
            del x
        del pool
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    emit(**result)


def w_snapshot(torch, args):
    torch.cuda.memory._record_memory_history(max_entries=10000)
    x = torch.randn(1024, 1024, device="cuda")
    y = x @ x
    snap = torch.cuda.memory._snapshot()
    frames = cpp = here = traced = 0
    for seg in snap.get("segments", []):
        for blk in seg.get("blocks", []):
            for fr in blk.get("frames", []) or []:
                if str(fr.get("filename", "")).endswith(".py"):
                    frames += 1
                elif fr.get("name"):
                    cpp += 1  # stacks="all" (the default): C++ frames too
                if str(fr.get("filename", "")).endswith("graphs_child.py") and fr.get("name") == "w_snapshot":
                    here += 1
    for trace in snap.get("device_traces", []):
        for ev in trace:
            if any(str(fr.get("filename", "")).endswith("graphs_child.py") for fr in ev.get("frames", []) or []):
                traced += 1
    # what memory_viz renders (the same code pytorch.org/memory_viz runs)
    from torch.cuda import _memory_viz

    pages = len(_memory_viz.segment_plot(snap)) + len(_memory_viz.trace_plot(snap))
    torch.cuda.memory._record_memory_history(enabled=None)
    emit(segments=len(snap.get("segments", [])), python_frames=frames, cpp_frames=cpp, frames_here=here,
         events_here=traced,
         viz_bytes=pages, y=float(y.double().sum()))


def _ipc_child(q, r):
    import torch

    t = q.get()
    import gpumem.torch

    r.put((float(t.double().sum()), gpumem.torch.is_enabled(), str(t.device)))
    del t


def w_ipc(torch, args):
    """A CUDA tensor sent to a spawned process through a torch.multiprocessing
    queue: under gpumem both processes run gpumem (the child through gpumem
    run's start-up hook), and the child must read the parent's values."""
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    t = torch.arange(1000, device="cuda", dtype=torch.float32)
    # torch's CUDA IPC runs when the tensor is pickled for another process:
    # a queue does that on its feeder thread, where an error would only be
    # printed (and the receiver would wait forever), so pickle here first.
    try:
        ForkingPickler.dumps(t)
    except Exception as e:
        emit(shared=False, message=str(e)[:600])
        return
    if args.allocator == "gpumem":
        boot = os.path.join(REPO, "python", "gpumem", "_bootstrap")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [boot, os.path.join(REPO, "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        os.environ["GPUMEM_ENABLE_TORCH"] = "1"
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(q, r), daemon=True)
    p.start()
    q.put(t)
    got, child_gpumem, device = r.get(timeout=180)
    p.join(60)
    emit(shared=True, sum=got, expected=float(t.double().sum()), child_gpumem=child_gpumem, device=device,
         exitcode=p.exitcode)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--allocator", default="gpumem", choices=("native", "gpumem"))
    ap.add_argument("--mode", default="infer")
    ap.add_argument("--lib", default=None, help="pool_allocator.cu built as a shared library")
    args = ap.parse_args()
    torch = setup(args)
    try:
        globals()["w_" + args.workload](torch, args)
    except Exception as e:
        import traceback

        traceback.print_exc()
        emit(error="%s: %s" % (type(e).__name__, str(e)[:2000]))


if __name__ == "__main__":
    main()
