"""Workloads for test_torch_gpumem.py, one per process.

    python3 _child.py WORKLOAD --allocator native|gpumem [--shim|--no-shim] [--conf C]

Each runs in a fresh interpreter because gpumem.torch.enable() must come
before PyTorch initializes CUDA. The last line printed is one JSON object
with the results; anything before it is diagnostics.
"""

import argparse
import json
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(REPO, "python"))


def emit(**result):
    print(json.dumps(result), flush=True)


def setup(args):
    """Installs the allocator (before any CUDA work), then imports torch
    with deterministic settings."""
    # cuBLAS needs a fixed workspace configuration to be deterministic.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.allocator == "gpumem":
        import gpumem.torch

        info = gpumem.torch.enable(args.conf, shim=args.shim)
        print("gpumem:", info, file=sys.stderr)
    import torch

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # warn_only: a few backward kernels (adaptive average pooling) are
    # flagged although they write each element once; see the test's note.
    torch.use_deterministic_algorithms(True, warn_only=True)
    warnings.filterwarnings("ignore", message=".*deterministic.*")
    return torch


# ---- training-step equality ------------------------------------------------


def gpt2(args):
    torch = setup(args)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # Default GPT2Config() is GPT-2 small (124M). Dropout off and eager
    # attention: the comparison is about memory, not about which attention
    # kernel or RNG stream runs.
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    try:
        cfg._attn_implementation = "eager"
    except Exception:
        pass
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(0, cfg.vocab_size, (4, 256), generator=gen).cuda()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    emit(losses=losses, **mem_figures(torch))


def resnet50(args):
    torch = setup(args)
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(16, 3, 224, 224, generator=gen).cuda()
        y = torch.randint(0, 1000, (16,), generator=gen).cuda()
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    emit(losses=losses, **mem_figures(torch))


def two_streams(args):
    """A loop on two streams whose memory passes between them where the
    program itself does not order them: the side stream stages the next
    input and computes on it without waiting for the main stream (so it
    takes memory the main stream's last step may still be using), and it
    frees a tensor while still computing on it, before the main stream
    allocates its activations. The side stream's peak comes before the main
    stream's, so gpumem's plan gives both one arena, and only its stream
    waits keep the results equal to the native allocator's."""
    torch = setup(args)
    torch.manual_seed(0)
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    n = 4096
    w_main = torch.randn(n, n, device="cuda") / n**0.5
    w_side = torch.randn(n, n, device="cuda") / n**0.5
    gen = torch.Generator().manual_seed(7)
    host = [torch.randn(1024, n, generator=gen).pin_memory() for _ in range(4)]
    with torch.cuda.stream(side):
        side_in = torch.randn(1024, n, device="cuda")
    main.wait_stream(side)
    totals = []
    for step in range(args.steps):
        with torch.cuda.stream(side):
            staged = host[step % 4].to("cuda", non_blocking=True)
            aux = [torch.tanh(staged @ w_side) for _ in range(3)]
            aux_sum = sum(a.sum() for a in aux)
            del aux
        main.wait_stream(side)
        staged.record_stream(main)
        aux_sum.record_stream(main)
        with torch.cuda.stream(side):
            tail = torch.tanh(side_in @ w_side)
            for _ in range(3):
                tail = torch.tanh(tail @ w_side)
            tail_sum = tail.sum()
            del tail  # freed while the side stream computes its sum
        x = staged
        act_sums = []
        for _ in range(6):
            x = torch.relu(x @ w_main)
            act_sums.append(x.sum())
        main.wait_stream(side)
        tail_sum.record_stream(main)
        totals.append(sum(act_sums) + aux_sum + tail_sum)
        del staged, x, act_sums, aux_sum, tail_sum
    torch.cuda.synchronize()
    result = {"sums": [t.item() for t in totals]}
    if args.allocator == "gpumem":
        import gpumem

        st = gpumem.memory_stats(torch.cuda.current_device())
        result.update(
            plans=st["num_plans"],
            plans_shared=st["num_plans_shared"],
            plans_declined=st["num_plans_declined"],
            planned_allocs=st["num_planned_allocs"],
            stream_waits=st["backend_calls.stream_wait"],
            event_records=st["backend_calls.event_record"],
            syncs=st["num_syncs"],
        )
    emit(**result, **mem_figures(torch))


def mem_figures(torch):
    return {
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
    }


# ---- out of memory and recovery ---------------------------------------------


def oom(args):
    torch = setup(args)
    import gpumem
    import gpumem.torch

    torch.manual_seed(0)
    width = 2048
    model = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        x = torch.randn(batch, width, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    step(64)  # optimizer state exists before the baseline is taken
    baseline = torch.cuda.memory_allocated()
    batch, caught, report, exc_type = 1024, None, "", ""
    while batch < (1 << 24):
        failed = False
        try:
            step(batch)
        except Exception as e:  # which class is what the test checks
            if not gpumem.torch.is_oom(e):
                raise
            failed = True
            exc_type = type(e).__module__ + "." + type(e).__name__
            report = str(e)
            is_torch_oom = isinstance(e, torch.OutOfMemoryError)
            is_runtime = isinstance(e, RuntimeError)
        if failed:
            # Outside the except block: the traceback no longer pins the
            # step's tensors.
            caught = batch
            break
        batch *= 2
    if caught is None:
        emit(error="no out-of-memory up to batch %d" % batch)
        return
    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    after_cleanup = torch.cuda.memory_allocated()
    losses = [step(caught // 4) for _ in range(3)]
    emit(
        oom_batch=caught,
        exc_type=exc_type,
        is_torch_oom=is_torch_oom,
        is_runtime_error=is_runtime,
        report=report[:2000],
        baseline=baseline,
        after_cleanup=after_cleanup,
        losses=losses,
        num_ooms=torch.cuda.memory_stats()["num_ooms"],
        limit_fraction=torch.cuda.get_per_process_memory_fraction()
        if hasattr(torch.cuda, "get_per_process_memory_fraction")
        else None,
    )


# ---- out of memory in PyTorch's form ------------------------------------------


def oom_form(args):
    """Under a per-process fraction, fails the same requests the same way
    under either allocator: the message, the observer's arguments, num_ooms,
    100 failed trials and what is left after them, a failure inside a
    captured graph and inside a MemPool."""
    torch = setup(args)
    import re

    total = torch.cuda.get_device_properties(0).total_memory
    cap = 4 << 30
    torch.cuda.set_per_process_memory_fraction(cap / total)
    calls = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: calls.append(list(a)))
    chunk = 256 << 20  # 256 MiB a tensor

    def fill():
        held = []
        while True:
            try:
                held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError as e:
                return held, str(e), type(e).__name__
            if len(held) > 1000:
                return held, "", "no failure"

    torch.empty(1, device="cuda")  # context and baseline
    base_allocated = torch.cuda.memory_allocated()
    held, message, etype = fill()
    filled = len(held)
    del held
    first = re.match(r"CUDA out of memory\. Tried to allocate [\d.]+ \w+\. GPU \d+ has a total capacit?y of [\d.]+ \w+", message)
    allowed = re.search(r"([\d.]+ \w+) allowed; ", message)
    ooms_before = torch.cuda.memory_stats().get("num_ooms", 0)
    calls_before = len(calls)
    # 100 failed trials: what unwinding frees is reusable at once
    trial_fills = []
    for _ in range(100):
        held, _, _ = fill()
        trial_fills.append(len(held))
        del held
    after_trials = torch.cuda.memory_allocated()
    ooms_after = torch.cuda.memory_stats().get("num_ooms", 0)
    calls_after_trials = len(calls)
    reserved_before_empty = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    reserved_after_empty = torch.cuda.memory_reserved()
    # inside a captured graph, and inside a MemPool
    graph = {}
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    x = torch.ones(16, device="cuda")
    with torch.cuda.stream(s):
        (x * 2).sum()
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(g, stream=s):
            y = x * 2
            big = torch.empty(cap * 2, dtype=torch.uint8, device="cuda")
        graph["raised"] = "nothing"
    except Exception as e:
        graph["raised"] = type(e).__name__
        graph["text_ok"] = str(e).startswith("CUDA out of memory.")
    torch.cuda.synchronize()
    graph["alloc_after"] = bool(torch.ones(1024, device="cuda").sum().item() == 1024)
    pool = {}
    if hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
        mp = torch.cuda.MemPool()
        try:
            with torch.cuda.use_mem_pool(mp):
                big = torch.empty(cap * 2, dtype=torch.uint8, device="cuda")
            pool["raised"] = "nothing"
        except Exception as e:
            pool["raised"] = type(e).__name__
            pool["text_ok"] = str(e).startswith("CUDA out of memory.")
        with torch.cuda.use_mem_pool(mp):
            t = torch.ones(1024, device="cuda")
        pool["alloc_after"] = bool(t.sum().item() == 1024)
        del t
    emit(
        message=message[:1500],
        exc_type=etype,
        first_sentence=first.group(0) if first else None,
        allowed=allowed.group(1) if allowed else None,
        filled=filled,
        trial_fills=sorted(set(trial_fills)),
        observer_calls=calls_before,
        observer_first=calls[0] if calls else None,
        observer_after_trials=calls_after_trials - calls_before,
        observer_graph_pool=len(calls) - calls_after_trials,
        ooms_graph_pool=torch.cuda.memory_stats().get("num_ooms", 0) - ooms_after,
        ooms_before=ooms_before,
        ooms_trials=ooms_after - ooms_before,
        base_allocated=base_allocated,
        after_trials=after_trials,
        reserved_before_empty=reserved_before_empty,
        reserved_after_empty=reserved_after_empty,
        graph=graph,
        pool=pool,
    )


# ---- the torch.cuda memory functions ----------------------------------------


def memfuncs(args):
    torch = setup(args)
    import gpumem
    import gpumem.torch

    checks = {}

    def check(name, cond):
        checks[name] = bool(cond)

    MIB = 1 << 20
    x = torch.zeros(10 * MIB, dtype=torch.uint8, device="cuda")
    a, r = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    check("allocated >= tensor", a >= 10 * MIB)
    check("allocated <= reserved", a <= r)
    check("torch == gpumem allocated", a == gpumem.memory_allocated())
    check("torch.cuda.memory agrees", torch.cuda.memory.memory_allocated() == a)
    y = torch.empty(50 * MIB, dtype=torch.uint8, device="cuda")
    del y
    check("peak covers freed tensor", torch.cuda.max_memory_allocated() >= 60 * MIB)
    check("max reserved >= reserved", torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved())
    torch.cuda.reset_peak_memory_stats()
    check("reset peak", torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated())
    stats = torch.cuda.memory_stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak", "num_ooms", "num_device_alloc"):
        check("stats has " + key, key in stats)
    check("stats: device allocations counted", stats.get("num_device_alloc", 0) > 0)
    summary = torch.cuda.memory_summary()
    check("summary is gpumem's", "gpumem memory summary" in summary)
    check("summary via torch.cuda.memory", "gpumem" in torch.cuda.memory.memory_summary())
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    check("empty_cache does not grow reserved", torch.cuda.memory_reserved() <= before)
    free, total = torch.cuda.mem_get_info()
    check("mem_get_info", 0 < free <= total)
    torch.cuda.set_per_process_memory_fraction(0.5)
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        check("fraction read back", abs(torch.cuda.get_per_process_memory_fraction() - 0.5) < 1e-3)
    check("limit applied", gpumem.memory_stats()["limit_bytes"] == int(total * 0.5))
    try:
        torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
        check("fraction enforced", False)
    except RuntimeError as e:  # torch.OutOfMemoryError, or RuntimeError without the shim
        check("fraction enforced", gpumem.torch.is_oom(e) and "gpumem: out of memory" in str(e))
    gpumem.allocator().remove_limit()
    # A side stream: record_stream goes through gpumem's hook.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        z = x.float() * 2
    x.record_stream(s)
    del x
    torch.cuda.synchronize()
    check("side-stream result", float(z[0]) == 0.0 and float(z[-1]) == 0.0)
    del z
    check("zero-size tensor", torch.empty(0, device="cuda").numel() == 0)
    p = torch.cuda.caching_allocator_alloc(4096)
    check("caching_allocator_alloc", p != 0)
    torch.cuda.caching_allocator_delete(p)
    # Graph capture: served by gpumem's full allocator when it was built,
    # else refused with the reason (test_graphs.py tests graphs in depth).
    if gpumem.torch.status()["graphs_path"]:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        a = torch.ones(1024, device="cuda")
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=s):
            b = a * 3
        a.fill_(2)
        g.replay()
        torch.cuda.synchronize()
        check("graph capture and replay", float(b.sum()) == 6 * 1024)
        del g, b
    else:
        try:
            g = torch.cuda.CUDAGraph()
            g.capture_begin()
            check("graph capture refused", False)
        except RuntimeError as e:
            check("graph capture refused", "full PyTorch allocator" in str(e))
    gpumem.torch.enable()  # again, same conf: a no-op
    try:
        gpumem.torch.enable("limit:1G")
        check("reconfigure refused", False)
    except RuntimeError:
        check("reconfigure refused", True)
    check("gpumem check", gpumem.allocator().check() == 0)
    emit(checks=checks, status=gpumem.torch.status())


def overflow(args):
    """The overflow tier under PyTorch (--conf overflow:host,limit:...):
    tensors past the cap on host pages, their values what was written,
    arithmetic on them right, memory_stats and the summary showing the host
    bytes, prefer_host on an optimizer's state, and the same values after
    empty_cache brought blocks back."""
    torch = setup(args)
    import gpumem
    import gpumem.torch

    checks = {}

    def check(name, cond):
        checks[name] = bool(cond)

    MIB = 1 << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.rand(64 * MIB // 4, device="cuda", generator=g) for _ in range(12)]  # 768 MiB
    sums = [float(t.double().sum()) for t in ts]
    stats = torch.cuda.memory_stats()
    check("some tensors on host pages", stats.get("num_host_allocs", 0) > 0)
    check("host bytes shown", stats.get("host_bytes.all.current", 0) > 0)
    check("summary row", "Host-backed memory" in torch.cuda.memory_summary())
    y = ts[-1] * 2 + ts[0]  # a kernel reading host pages and device pages
    check("kernel over host pages", abs(float(y.double().sum()) - (2 * sums[-1] + sums[0])) < 1e-3 * abs(sums[-1]))
    del y
    for t in ts[:6]:
        t.zero_()
    del ts[:6]
    sums = sums[6:]
    torch.cuda.empty_cache()
    stats = torch.cuda.memory_stats()
    check("moved back at empty_cache", stats.get("num_moves_to_device", 0) > 0)
    check("values after moving back", all(abs(float(t.double().sum()) - s) < 1e-6 * abs(s) for t, s in zip(ts, sums)))
    taken = gpumem.torch.prefer_host(ts)
    check("prefer_host took some", taken > 0)
    check("values after the hint", all(abs(float(t.double().sum()) - s) < 1e-6 * abs(s) for t, s in zip(ts, sums)))
    check("gpumem check", gpumem.allocator().check() == 0)
    emit(checks=checks, stats={k: v for k, v in stats.items() if "host" in k or "moves" in k})


def snapshot(args):
    """torch.cuda.memory's history and snapshot functions through gpumem,
    read back by PyTorch's own memory_viz code."""
    torch = setup(args)
    import pickle
    import tempfile

    from torch.cuda import _memory_viz

    import gpumem

    checks = {}

    def check(name, cond):
        checks[name] = bool(cond)

    torch.cuda.memory._record_memory_history(max_entries=10000)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    events = snap["device_traces"][torch.cuda.current_device()]
    actions = [e["action"] for e in events]
    check("events recorded", actions.count("alloc") > 10 and actions.count("free_completed") > 5)
    allocated = sum(seg["allocated_size"] for seg in snap["segments"])
    check("segments' allocated == memory_allocated", allocated == torch.cuda.memory_allocated())
    total = sum(seg["total_size"] for seg in snap["segments"])
    spare = sum(info["spare_bytes"] for info in snap["gpumem"].values())
    check("segments + spare == memory_reserved", total + spare == torch.cuda.memory_reserved())
    check("memory_snapshot() is the segments", torch.cuda.memory_snapshot() == snap["segments"])
    # PyTorch's readers: segsum asserts that blocks fill their segments,
    # trace replays the events, trace_plot embeds the pickle for the viewer.
    summary = _memory_viz.segsum(snap)
    check("segsum", "total_reserved" in summary)
    check("trace", "entries" in _memory_viz.trace(snap))
    check("trace_plot", "snapshot.pickle" in _memory_viz.trace_plot(snap))
    path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        dumped = pickle.load(f)
    check("_dump_snapshot pickles gpumem's", len(dumped["segments"]) > 0 and "gpumem" in dumped)
    # gpumem top sees this process (publication is on over CUDA by default)
    import subprocess

    gpumem.allocator().publish()
    top = subprocess.run([os.path.join(REPO, "build", "gpumem"), "top", "--json"], capture_output=True, text=True)
    mine = [r for r in json.loads(top.stdout or "[]") if r["pid"] == os.getpid()]
    check("gpumem top lists this process", len(mine) == 1)
    if mine:
        check("top: device", mine[0]["device"] == torch.cuda.current_device())
        check("top: allocated", mine[0]["allocated_bytes"] == torch.cuda.memory_allocated())
        check("top: reserved", mine[0]["reserved_bytes"] == torch.cuda.memory_reserved())
    torch.cuda.memory._record_memory_history(enabled=None)
    check("recording stops", torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()] == [])
    emit(checks=checks, segments=len(snap["segments"]), events=len(events), segsum=summary.splitlines()[-12:])


def leaks(args):
    """gpumem.leak_check around PyTorch code: evaluation without no_grad that
    keeps its outputs (each keeps its graph's activations alive) is caught,
    one group per activation size, counted once a step; the same loop that
    keeps only .item() and a plain training step are clean. Then the
    out-of-memory post-mortem (run with --conf ...,oom_snapshot:PATH):
    torch's OutOfMemoryError names the file, which PyTorch's segsum reads."""
    torch = setup(args)
    import gpumem

    checks = {}

    def check(name, cond):
        checks[name] = bool(cond)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 1024, device="cuda")

    def train_step():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: cuBLAS workspaces and the like live on
        train_step()
        model(x).sum().item()
    torch.cuda.synchronize()
    with gpumem.leak_check(action="raise") as step_check:
        for _ in range(3):
            train_step()
    check("a training step keeps nothing", step_check.leaks["count"] == 0)
    total = 0.0
    with gpumem.leak_check(action="raise") as clean:
        for _ in range(5):
            total += model(x).sum().item()
    check("keeping .item() keeps nothing", clean.leaks["count"] == 0)
    kept = []
    with gpumem.leak_check(action=None) as bad:
        for step in range(5):
            gpumem.allocator().set_history_tag(step + 1)
            kept.append(model(x).sum())
    gpumem.allocator().set_history_tag(0)
    groups = bad.leaks["groups"]
    hidden = 256 * 4096 * 4
    check("kept graphs are found", bad.leaks["count"] >= 5)
    check("the hidden activations form a group of one a step",
          any(g["requested"] == hidden and g["count"] % 5 == 0 and g["first_tag"] == 1 and g["last_tag"] == 5 for g in groups))
    check("the report says so", "still live" in bad.report and "tags 1..5" in bad.report)
    del kept
    check("once dropped, nothing", gpumem.leaks(bad.mark)["count"] == 0)
    # the whole loop watched through torch.optim's step hook: four clean
    # steps, then each keeps its loss (one scalar a step)
    import gpumem.torch

    watcher = gpumem.torch.watch_leaks(patience=3, action=None)
    history = []
    for step in range(10):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 4:
            history.append(loss)
    watcher.remove()
    opt.step()  # not counted once removed
    reports = watcher.reports
    check("watch_leaks: counted every step", watcher.steps == 10)
    check("watch_leaks: one report, at the step after three kept losses", [r["steps"] for r in reports] == [8])
    watched = reports[0]["groups"] if reports else []
    # the three kept losses and the current step's own (alive at its hook)
    scalar = [g for g in watched if g["requested"] == 4]
    check("watch_leaks: the kept losses", len(scalar) == 1 and scalar[0]["count"] == 4)
    del history
    report = ""
    try:
        torch.empty(200 << 30, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        report = str(e)
    post = "Post-mortem: snapshot written to "
    check("the OOM report names the post-mortem", post in report)
    if post in report:
        from torch.cuda import _memory_viz

        path = report.split(post, 1)[1].split(".json", 1)[0] + ".json"
        with open(path) as f:
            snap = json.load(f)
        for seg in snap["segments"]:
            seg["segment_pool_id"] = tuple(seg["segment_pool_id"])
        allocated = sum(seg["allocated_size"] for seg in snap["segments"])
        check("post-mortem's allocated == memory_allocated", allocated == torch.cuda.memory_allocated())
        check("post-mortem read by segsum", "total_reserved" in _memory_viz.segsum(snap))
    check("gpumem check", gpumem.allocator().check() == 0)
    emit(
        checks=checks,
        groups=groups[:3],
        report=bad.report.splitlines()[:4],
        watched=[(g["requested"], g["count"]) for g in watched],
        oom=report[-300:],
    )


def budget_hold(args):
    """Holds --gib GiB under the budget of --conf, prints one JSON line,
    then waits to be killed (the test kills it: a process that dies holding
    memory)."""
    torch = setup(args)
    import time

    kept = torch.empty(args.gib << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    emit(held=torch.cuda.memory_reserved(), ptr=kept.data_ptr())
    sys.stdout.flush()
    time.sleep(600)


def budget_take(args):
    """Tries to take --gib GiB under the budget of --conf; reports whether
    it was refused and the report's text."""
    torch = setup(args)
    try:
        x = torch.empty(args.gib << 30, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        emit(refused=False, reserved=torch.cuda.memory_reserved(), size=x.numel())
    except torch.OutOfMemoryError as e:
        emit(refused=True, report=str(e))


def too_late(args):
    import torch

    torch.zeros(1, device="cuda")
    sys.path.insert(0, os.path.join(REPO, "python"))
    import gpumem.torch

    try:
        gpumem.torch.enable()
        emit(raised=False)
    except RuntimeError as e:
        emit(raised=True, message=str(e))


def bad_conf(args):
    import gpumem
    import gpumem.torch

    try:
        gpumem.torch.enable("limt:2G")
        emit(raised=None)
    except gpumem.ConfigError as e:
        import torch

        emit(raised="ConfigError", message=str(e), cuda_initialized=torch.cuda.is_initialized())


# ---- CuPy --------------------------------------------------------------------


def cupy_work(args):
    import numpy as np

    import gpumem
    import gpumem.cupy

    gpumem.cupy.enable(args.conf, stream_aware=args.stream_aware)
    import cupy

    checks = {}
    n = 1_000_000
    a = cupy.arange(n, dtype=cupy.float32)
    b = a * 2 + 1
    checks["elementwise"] = bool(np.array_equal(cupy.asnumpy(b), np.arange(n, dtype=np.float32) * 2 + 1))
    rng = np.random.default_rng(0)
    m1, m2 = rng.standard_normal((256, 128)), rng.standard_normal((128, 64))
    checks["matmul"] = bool(np.allclose(cupy.asnumpy(cupy.asarray(m1) @ cupy.asarray(m2)), m1 @ m2, rtol=1e-10))
    # In float64 the sum of 0..n-1 is exact, whatever the reduction order.
    checks["reduction"] = float(cupy.sum(a, dtype=cupy.float64)) == float(np.arange(n, dtype=np.float64).sum())
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        c = cupy.ones(n, dtype=cupy.float64) + a
    s.synchronize()
    checks["side stream"] = float(c[10]) == 11.0
    checks["gpumem counts it"] = gpumem.memory_allocated(0) >= 3 * n * 4
    gpumem.allocator(0).set_limit("256M")
    try:
        cupy.empty(1 << 30, dtype=cupy.uint8)
        checks["oom raised"] = False
    except cupy.cuda.memory.OutOfMemoryError as e:
        checks["oom raised"] = True
        checks["oom is gpumem's"] = isinstance(e, gpumem.OutOfMemoryError) and "gpumem: out of memory" in str(e)
    gpumem.allocator(0).remove_limit()
    before = gpumem.memory_allocated(0)
    del a, b, c
    cupy.cuda.Device().synchronize()
    checks["freed"] = gpumem.memory_allocated(0) <= before - (2 * n * 4 + n * 8)
    checks["gpumem check"] = gpumem.allocator(0).check() == 0
    emit(checks=checks)


# ---- data parallel (under torchrun) -----------------------------------------


def ddp(args):
    torch = setup(args)
    import torch.distributed as dist

    import gpumem

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(64, 512, generator=gen).cuda()
        y = torch.randint(0, 10, (64,), generator=gen).cuda()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered)
    allocated = gpumem.memory_allocated(local) if args.allocator == "gpumem" else torch.cuda.memory_allocated()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        emit(world=world, params_equal=same, losses=losses, allocated=allocated)


WORKLOADS = {
    "gpt2": gpt2,
    "resnet50": resnet50,
    "oom": oom,
    "memfuncs": memfuncs,
    "too_late": too_late,
    "bad_conf": bad_conf,
    "cupy": cupy_work,
    "ddp": ddp,
    "two_streams": two_streams,
    "snapshot": snapshot,
    "oom_form": oom_form,
    "leaks": leaks,
    "budget_hold": budget_hold,
    "budget_take": budget_take,
    "overflow": overflow,
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--allocator", choices=["native", "gpumem"], default="gpumem")
    p.add_argument("--conf", default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gib", type=int, default=1)
    p.add_argument("--no-shim", dest="shim", action="store_false")
    p.add_argument("--no-stream-aware", dest="stream_aware", action="store_false")
    args = p.parse_args()
    WORKLOADS[args.workload](args)


if __name__ == "__main__":
    main()
