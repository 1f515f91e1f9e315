"""Two-GPU training (FSDP2 or DDP) under PyTorch's native allocator, expandable segments and gpumem,
the sides trained in turns step by step on the same GPUs: step times, peak memory and losses.

    python3 bench/torch/multigpu.py run --strategy fsdp2|ddp [--sides native,expandable,gpumem]
            [--steps 40] [--warmup 6] [--varlen] [--deterministic] [--out DIR] [--timeout 540]

Each side is its own torchrun job of --nproc ranks, one per GPU (gpumem's: torchrun -m gpumem.torch
multigpu.py worker ...). A seeded Llama decoder trains on seeded batches; step k of each side runs
alone on the GPUs, the order rotating every step, and is paired with native's step k (lockstep_ab's
compare: ratio of medians, geometric mean, 95% intervals). Writes DIR/result.json and a table.
"""

import argparse
import json
import math
import os
import random
import select
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
THIS_FILE = os.path.abspath(__file__)
GIB = 2**30

# What each strategy trains (per rank). Three sides share each GPU, so each must stay under
# ~22 GB of an 80 GB card. Estimates, with batch x seq tokens per rank:
#  fsdp2: 1.12e9 parameters (embeddings and lm_head 2 x 65.5M, 22 layers x 45.1M). fp32
#    weights + gradients + AdamW state sharded over 2 ranks ~9 GB a rank; bf16 activations of
#    2 x 2048 tokens ~8 GB (~90 KB a token and layer) + ~1.5 GB of logits and loss: ~19-20 GB
#    allocated at the peak.
#  ddp: 0.25e9 parameters (2 x 32.8M + 16 layers x 11.3M). fp32 weights, gradients, DDP's
#    buckets and AdamW state ~5 GB; activations under bf16 autocast of 4 x 1024 tokens ~4 GB
#    + ~1.5 GB logits: ~11 GB (~17 GB with --varlen at 4 x 2048).
# --varlen draws the sequence length of each step from [varlen[0], varlen[1]].
WORKLOADS = {
    "fsdp2": {"hidden": 2048, "intermediate": 5632, "layers": 22, "heads": 16, "kv_heads": 4,
              "batch": 2, "seq": 2048, "varlen": (512, 2048)},
    "ddp": {"hidden": 1024, "intermediate": 2816, "layers": 16, "heads": 16, "kv_heads": 4,
            "batch": 4, "seq": 1024, "varlen": (512, 2048)},
}
ALLOCATORS = ("native", "expandable", "gpumem")
# Mandatory on the shared GPU hosts: NVLink multicast stays off in NCCL, PyTorch and NVSHMEM.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SPEED_RATIO_MAX = 1.01  # gpumem / native, ratio of the median step times ...
SPEED_CI_HIGH_MAX = 1.02  # ... and the upper end of its 95% interval (as userjobs.py)
GRACE_S = 20  # once a rank of a side failed: how long its other ranks may take to answer or exit
KILL_GRACE_S = 8  # from SIGTERM to SIGKILL when the driver ends a job
RUN_KEYS = ("strategy", "side", "steps", "warmup", "seed", "varlen", "deterministic", "workload")  # in result.json once
STAT_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms", "num_sync_all_streams")
GPUMEM_KEYS = ("num_syncs", "num_sync_all_streams", "num_pages_mapped", "num_pages_unmapped", "num_reclaims",
               "num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms", "num_plans",
               "num_plan_drops", "num_planned_allocs", "num_pages_revived", "num_pages_aliased")


def seq_len(strategy, varlen, seed, step):
    """The sequence length of step `step`: the same on every rank and every side."""
    wl = WORKLOADS[strategy]
    if not varlen:
        return wl["seq"]
    lo, hi = wl["varlen"]
    return random.Random("len:%d:%d" % (seed, step)).randint(lo, hi)


def data_seed(seed, step, rank):
    """The token generator's seed of (seed, step, rank)."""
    return ((seed * 1_000_003) + step) * 1009 + rank


def allocator_used(backend, alloc_conf, gpumem_enabled, expandable_seen=None):
    """Which allocator the process really trained with."""
    if gpumem_enabled:
        return "gpumem"
    if backend == "cudaMallocAsync":
        return "async"
    if expandable_seen is not None:
        return "expandable" if expandable_seen else "native"
    conf = (alloc_conf or "").replace(" ", "").lower()
    return "expandable" if "expandable_segments:true" in conf else "native"


# ---- worker: one rank of one side (under torchrun) ---------------------------------------------


class TorchJob:
    """A Llama decoder trained with FSDP2 or DDP on this rank's GPU."""

    def __init__(self, args, rank, local, world):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.args, self.rank = torch, dist, args, rank
        if args.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        torch.cuda.set_device(local)
        self.dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=self.dev)

        from transformers import LlamaForCausalLM

        sys.path.insert(0, HERE)
        from workloads import llama_config

        t0 = time.perf_counter()
        wl = self.wl = WORKLOADS[args.strategy]
        cfg = llama_config(wl["hidden"], wl["intermediate"], wl["layers"], wl["heads"], wl["kv_heads"],
                           use_cache=False)
        self.vocab = cfg.vocab_size
        torch.manual_seed(args.seed)  # the same weights on every rank and every side
        with self.dev:
            model = LlamaForCausalLM(cfg)
        model.train()
        self.params = sum(p.numel() for p in model.parameters())
        if args.strategy == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            self.autocast = False
        else:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[local])
            self.autocast = True
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.gen = torch.Generator(device=self.dev)
        self.seq_lens = []
        torch.cuda.synchronize()
        self.build_s = time.perf_counter() - t0
        self.build_reserved = torch.cuda.memory_reserved(self.dev)
        self.build_allocated = torch.cuda.memory_allocated(self.dev)

    def step(self, k):
        torch, args = self.torch, self.args
        s = seq_len(args.strategy, args.varlen, args.seed, k)
        self.seq_lens.append(s)
        self.gen.manual_seed(data_seed(args.seed, k, self.rank))
        ids = torch.randint(0, self.vocab, (self.wl["batch"], s), device=self.dev, generator=self.gen)
        if self.autocast:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self.model(input_ids=ids, labels=ids).loss
        else:
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return loss.detach()

    def is_oom(self, exc):
        if isinstance(exc, self.torch.OutOfMemoryError):
            return True
        gt = sys.modules.get("gpumem.torch")
        return gt is not None and gt.is_enabled() and gt.is_oom(exc)

    def report(self):
        torch = self.torch
        gt = sys.modules.get("gpumem.torch")
        enabled = bool(gt is not None and gt.is_enabled())
        backend = torch.cuda.memory.get_allocator_backend()
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
        expandable_seen = None
        if not enabled:
            try:  # segments of expandable_segments:True say so in the snapshot
                expandable_seen = any(s.get("is_expandable") for s in torch.cuda.memory_snapshot())
            except Exception:
                pass
        st = torch.cuda.memory_stats(self.dev)
        import transformers

        out = {
            "device": torch.cuda.get_device_name(self.dev),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "params": self.params,
            "build_s": round(self.build_s, 2),
            "build_reserved": self.build_reserved,
            "build_allocated": self.build_allocated,
            "seq_lens": self.seq_lens,
            "allocator_backend": backend,
            "alloc_conf": conf,
            "expandable_segments_seen": expandable_seen,
            "gpumem_enabled": enabled,
            "allocator_used": allocator_used(backend, conf, enabled, expandable_seen),
            "peak_reserved": torch.cuda.max_memory_reserved(self.dev),
            "peak_allocated": torch.cuda.max_memory_allocated(self.dev),
            "memory_stats": {k: st[k] for k in STAT_KEYS if k in st},
        }
        if enabled:
            import gpumem

            out["gpumem_status"] = gt.status()
            gst = gpumem.memory_stats(self.dev.index)
            out["gpumem"] = {k: gst[k] for k in GPUMEM_KEYS if k in gst}
            out["gpumem"]["policy"] = gpumem.allocator(self.dev.index).policy  # not in memory_stats
            out["gpumem"].update({k: v for k, v in gst.items() if k.startswith("backend_calls.") and v})
        return out

    def close(self):
        self.dist.destroy_process_group()


class FakeOutOfMemory(Exception):
    pass


def fake_setting(name, side, default):
    """SIDE=VALUE,... from the environment variable name: side's value or default."""
    for item in os.environ.get(name, "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == side and value:
            return float(value)
    return default


def fake_events(side, rank):
    """MULTIGPU_FAKE_EVENTS=SIDE:WHAT:STEP[:RANK],... -> {step: what} for this side and rank;
    WHAT is oom, die or hang; step -1 with die: exit before opening the FIFOs."""
    out = {}
    for item in os.environ.get("MULTIGPU_FAKE_EVENTS", "").split(","):
        parts = item.strip().split(":")
        if len(parts) >= 3 and parts[0] == side and (len(parts) < 4 or int(parts[3]) == rank):
            out[int(parts[2])] = parts[1]
    return out


class FakeJob:
    """TorchJob's stand-in for a dry run of the turn protocol (worker --fake): sleeps instead of
    training, needs no torch, reports the same keys (fake figures)."""

    def __init__(self, args, rank, local, world):
        self.args, self.rank = args, rank
        self.ms = fake_setting("MULTIGPU_FAKE_MS", args.side, 20.0)
        self.events = fake_events(args.side, rank)
        self.spans = []  # wall-clock (start, end) of each step: the dry test checks turns never overlap
        self.seq_lens = []

    def step(self, k):
        what = self.events.get(k)
        if what == "oom":
            raise FakeOutOfMemory("fake: out of memory at step %d" % k)
        if what == "die":
            raise RuntimeError("fake: a failure at step %d" % k)
        if what == "hang":  # a rank stuck in a collective that ignores SIGTERM
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(3600)
        t0 = time.time()
        s = seq_len(self.args.strategy, self.args.varlen, self.args.seed, k)
        self.seq_lens.append(s)
        time.sleep(self.ms * (0.5 + s / 4096) / 1e3)
        self.spans.append([t0, time.time()])
        return 10.0 / (1 + k) + 0.001 * self.rank  # the same on every side

    def is_oom(self, exc):
        return isinstance(exc, FakeOutOfMemory)

    def report(self):
        enabled = os.environ.get("MULTIGPU_FAKE_GPUMEM") == "1"
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        peak = fake_setting("MULTIGPU_FAKE_PEAK_GIB", self.args.side,
                            {"native": 12.0, "expandable": 11.0, "gpumem": 10.0}.get(self.args.side, 12.0))
        return {
            "device": "fake", "torch": None, "transformers": None, "params": 0, "build_s": 0.0,
            "seq_lens": self.seq_lens, "allocator_backend": "native", "alloc_conf": conf,
            "gpumem_enabled": enabled, "allocator_used": allocator_used("native", conf, enabled),
            "peak_reserved": int(peak * GIB), "peak_allocated": int(9.5 * GIB), "memory_stats": {},
            "fake_spans": self.spans,
        }

    def close(self):
        pass


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def worker(args):
    """One rank: opens its FIFOs, builds the job, then per step waits for a go line, trains, and
    answers `MS LOSS` (or `oom`); at the end writes its JSON result."""
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    base = os.path.join(args.turns, "%s.r%d" % (args.side, rank))
    with open(base + ".pid", "w") as f:  # the driver kills by pid what torchrun leaves behind
        f.write("%d\n" % os.getpid())
    if args.fake and fake_events(args.side, rank).get(-1) == "die":
        sys.exit("fake: a failure before opening the FIFOs")
    # The driver holds both FIFOs open already (go read-write, done for reading), so neither open
    # blocks; go first, then done (see Driver.open_fifos).
    go = open(base + ".go", "r")
    done = open(base + ".done", "w", buffering=1)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    job = (FakeJob if args.fake else TorchJob)(args, rank, local, world)

    all_ms, losses = [], []
    ended, oom_message = "done", None
    for k in range(args.warmup + args.steps):
        line = go.readline()
        if not line:
            raise SystemExit("multigpu worker: the driver went away before step %d" % k)
        if line.strip() == "stop":  # the side stopped (another rank failed): report and go
            ended = "stopped by the driver"
            break
        t0 = time.perf_counter()
        try:
            loss = job.step(k)
        except Exception as e:  # out of memory is a result, anything else a failure
            if not job.is_oom(e):
                raise
            ended, oom_message = "oom", (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            print("multigpu worker %s rank %d: out of memory at step %d: %s" % (args.side, rank, k, oom_message),
                  file=sys.stderr, flush=True)
            break
        ms = (time.perf_counter() - t0) * 1e3
        loss = float(loss)  # .item(): the step has synchronized already
        all_ms.append(ms)
        losses.append(loss)
        done.write("%.4f %r\n" % (ms, loss))

    result = {
        "strategy": args.strategy, "side": args.side, "rank": rank, "local_rank": local, "world_size": world,
        "steps": args.steps, "warmup": args.warmup, "seed": args.seed, "varlen": args.varlen,
        "deterministic": args.deterministic, "workload": WORKLOADS[args.strategy],
        "step_ms": [round(t, 4) for t in all_ms[args.warmup:]],  # the timed steps
        "all_step_ms": [round(t, 4) for t in all_ms],
        "losses": losses,  # every step's, warm-up included
        "ended": ended, "stopped_at": None if ended == "done" else len(all_ms), "oom_message": oom_message,
        "multicast_env": {k: os.environ.get(k) for k in NO_MULTICAST},
    }
    result.update(job.report())
    write_json(base + ".json", result)
    if ended != "done":
        if ended == "oom":
            done.write("oom\n")
        sys.stdout.flush()
        sys.stderr.flush()
        # Status 0, so that torchrun leaves the other ranks be: the driver tells them to stop (and
        # write their results) or ends the job. No destroy_process_group: the other ranks may be
        # gone or stuck in a collective.
        os._exit(0)
    go.close()
    done.close()
    job.close()


def fakerun(argv):
    """torchrun's stand-in for the dry run: `fakerun NPROC SCRIPT ARGS...` starts NPROC ranks
    (RANK, LOCAL_RANK, WORLD_SIZE set), each in its own session as torchrun does; the first to
    fail ends the others (SIGTERM), and SIGTERM to it goes on to them."""
    n, cmd = int(argv[0]), argv[1:]
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
        procs.append(subprocess.Popen([sys.executable] + cmd, env=env, start_new_session=True))

    def end(status):
        for p in procs:
            if p.poll() is None:
                p.terminate()
        t_end = time.time() + 5
        while time.time() < t_end and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        sys.exit(status)  # a rank that ignored SIGTERM stays behind, as under a stuck torchrun

    signal.signal(signal.SIGTERM, lambda signum, frame: end(128 + signum))
    while True:
        codes = [p.poll() for p in procs]
        bad = [c for c in codes if c not in (None, 0)]
        if bad:
            end(1)
        if all(c == 0 for c in codes):
            sys.exit(0)
        time.sleep(0.05)


# ---- driver -------------------------------------------------------------------------------------


class Timeout(Exception):
    pass


class DonePipe:
    """The driver's end of a rank's done FIFO: lines read without blocking."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.buf = b""
        self.eof = False

    def line(self):
        i = self.buf.find(b"\n")
        if i < 0:
            return None
        line, self.buf = self.buf[:i], self.buf[i + 1:]
        return line.decode(errors="replace").strip()

    def fill(self):
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:  # a writer is there, with nothing to say yet
            return
        if data:
            self.buf += data
        else:
            self.eof = True  # the rank closed it: it exited (or never opened it and its job is gone)


class Side:
    def __init__(self, name, nproc, turns, out):
        self.name = name
        self.nproc = nproc
        self.base = [os.path.join(turns, "%s.r%d" % (name, r)) for r in range(nproc)]
        self.log = os.path.join(out, name + ".log")
        self.go, self.done = [], []
        self.proc = None
        self.ms = [[] for _ in range(nproc)]  # timed steps (after the warm-up), per rank
        self.all_ms = [[] for _ in range(nproc)]
        self.losses = [[] for _ in range(nproc)]  # every step's
        self.status = "running"  # then ok, oom, died, timeout or error
        self.stopped_at = None
        self.reason = None
        self.exit = None


def free_ports(n):
    """n distinct free TCP ports of 127.0.0.1 (held together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def log_tail(path, lines=25):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return "(no log: %s)" % e
    return "\n".join(text.splitlines()[-lines:])


def gib(n):
    return None if n is None else round(n / GIB, 3)


class Driver:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.turns = os.path.join(self.out, "turns")
        os.makedirs(self.turns, exist_ok=True)
        self.sides = [Side(name, args.nproc, self.turns, self.out) for name in args.sides]
        self.order = []  # per step, the sides in the order they ran

    # -- setting up

    def open_fifos(self):
        """Makes and opens every FIFO before any job starts, so that no open blocks anywhere.
        Opening a FIFO blocks until the other end is open too (a reader waits for a writer and a
        writer for a reader), so a rank that never starts could hang a driver that waited in
        open(), and a driver opening in another order than the ranks could deadlock with them.
        Instead the driver opens go read-write (O_RDWR on a FIFO never blocks on Linux, and since
        the driver holds a read end itself, its writes never fail with EPIPE if the rank died) and
        done read-only with O_NONBLOCK (returns at once with no writer). Each rank then opens go
        for reading, then done for writing: both find the other end open and return at once, in
        whatever order the ranks come. Reading done, the driver select()s with a deadline and
        watches the job, and a rank that closes done (it exited) shows as end of file."""
        for side in self.sides:
            for base in side.base:
                for suffix in (".go", ".done", ".json", ".json.tmp", ".pid"):
                    if os.path.lexists(base + suffix):
                        os.unlink(base + suffix)
                os.mkfifo(base + ".go", 0o600)
                os.mkfifo(base + ".done", 0o600)
                side.go.append(os.open(base + ".go", os.O_RDWR))
                side.done.append(DonePipe(base + ".done"))

    def env(self, name):
        args = self.args
        env = dict(os.environ)
        for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GPUMEM_ENABLE_TORCH"):
            env.pop(key, None)  # each side gets only its own allocator (GPUMEM_ENABLE_TORCH: `gpumem run`)
        if name == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if name != "gpumem":
            env.pop("GPUMEM_CONF", None)
        if name == "gpumem" and args.launcher == "fake":
            env["MULTIGPU_FAKE_GPUMEM"] = "1"
        # -m gpumem.torch: this checkout's package (it finds build/libgpumem.so, or GPUMEM_LIBRARY)
        python_dir = os.path.join(REPO, "python")
        env["PYTHONPATH"] = python_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(NO_MULTICAST)
        if args.deterministic:
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def command(self, name, port):
        args = self.args
        worker_args = [THIS_FILE, "worker", "--strategy", args.strategy, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--turns", self.turns, "--side", name,
                       "--seed", str(args.seed)]
        if args.varlen:
            worker_args.append("--varlen")
        if args.deterministic:
            worker_args.append("--deterministic")
        if args.launcher == "fake":
            return [sys.executable, THIS_FILE, "fakerun", str(args.nproc)] + worker_args + ["--fake"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
               str(args.nproc), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        if name == "gpumem":
            cmd += ["-m", "gpumem.torch"]
        return cmd + worker_args

    def start(self):
        ports = free_ports(len(self.sides))
        for side, port in zip(self.sides, ports):
            cmd = self.command(side.name, port)
            with open(side.log, "w") as log:
                log.write("# %s\n" % " ".join(cmd))
                log.flush()
                side.proc = subprocess.Popen(cmd, env=self.env(side.name), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    # -- the turns

    def answers(self, side, deadline):
        """One line from each rank of side (None for a rank that exited without one). Raises
        Timeout at the deadline. Once a rank failed (oom, or gone), the others get GRACE_S."""
        got = [None] * side.nproc
        have = [False] * side.nproc
        failed_at = None
        while True:
            for r, pipe in enumerate(side.done):
                if not have[r]:
                    line = pipe.line()
                    if line is not None or pipe.eof:
                        got[r], have[r] = line, True
            if all(have):
                return got
            if failed_at is None and any(h and (g is None or g.startswith("oom")) for g, h in zip(got, have)):
                failed_at = time.time()
            limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
            wait = limit - time.time()
            if wait <= 0:
                if failed_at is not None:
                    return got  # the ranks still silent count as gone
                raise Timeout()
            pending = {side.done[r].fd: side.done[r] for r in range(side.nproc) if not have[r]}
            ready, _, _ = select.select(list(pending), [], [], min(wait, 0.5))
            for fd in ready:
                pending[fd].fill()
            if not ready and side.proc.poll() is not None:
                for pipe in pending.values():  # the job is gone: what it wrote, then end of file
                    pipe.fill()
                    pipe.eof = True  # (a rank torchrun left behind may hold the pipe open)

    def turn(self, side, k, deadline):
        for fd in side.go:
            os.write(fd, b"go\n")
        got = self.answers(side, deadline)
        parsed, why = [], None
        silent = [r for r, line in enumerate(got) if line is None]
        if silent:
            why = ("died", "rank%s %s gave no answer at step %d (exited, or still silent %d s after another "
                   "rank failed)" % ("s" if len(silent) > 1 else "", ", ".join(map(str, silent)), k, GRACE_S))
        for r, line in enumerate(got):
            if line is None:
                continue
            if line.startswith("oom"):
                why = ("oom", "rank %d ran out of memory at step %d" % (r, k))
                continue
            try:
                ms, loss = line.split()
                parsed.append((float(ms), float(loss)))
            except ValueError:
                why = why or ("error", "rank %d answered %r at step %d" % (r, line, k))
        if why is None:
            for r, (ms, loss) in enumerate(parsed):
                side.all_ms[r].append(ms)
                side.losses[r].append(loss)
                if k >= self.args.warmup:
                    side.ms[r].append(ms)
            return
        side.status, side.reason = why
        side.stopped_at = k
        print("multigpu: %s stopped: %s" % (side.name, side.reason), file=sys.stderr, flush=True)
        self.stop_job(side, deadline)

    def stop_job(self, side, deadline):
        """Lets the side's live ranks write their results (stop), then ends the job."""
        for fd in side.go:
            os.write(fd, b"stop\n")
        t_end = min(time.time() + KILL_GRACE_S, deadline)  # a rank waiting for a turn exits at once
        while side.proc.poll() is None and time.time() < t_end:
            time.sleep(0.1)
        self.kill_jobs([side])

    def kill_jobs(self, sides, grace=KILL_GRACE_S):
        """Ends jobs: SIGTERM to each torchrun's process group (torchrun passes it on to its
        ranks), SIGKILL to the groups still there after grace seconds, then SIGKILL to any rank
        left: torchrun starts each rank in a session of its own, so the ranks' pids come from
        their .pid files."""
        live = [s for s in sides if s.proc is not None and s.proc.poll() is None]
        for side in live:
            try:
                os.killpg(side.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        t_end = time.time() + grace
        while any(s.proc.poll() is None for s in live) and time.time() < t_end:
            time.sleep(0.1)
        for side in live:
            if side.proc.poll() is None:
                try:
                    os.killpg(side.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                side.proc.wait()
        for side in sides:
            for base in side.base:
                try:
                    with open(base + ".pid") as f:
                        pid = int(f.read().strip())
                    with open("/proc/%d/cmdline" % pid, "rb") as f:
                        cmdline = f.read()
                except (OSError, ValueError):
                    continue  # no pid file, or the rank is gone
                if os.path.basename(THIS_FILE).encode() not in cmdline or b"worker" not in cmdline:
                    continue  # the pid is something else's now
                try:
                    if os.getpgid(pid) == pid:
                        os.killpg(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if side.proc is not None and side.exit is None:
                side.exit = side.proc.returncode

    def run(self):
        args = self.args
        t_start = time.time()
        # the jobs' ending (kill_jobs) fits in --timeout too
        deadline = t_start + max(args.timeout - KILL_GRACE_S, args.timeout / 2)
        self.open_fifos()
        k = 0
        try:
            self.start()
            for k in range(args.warmup + args.steps):
                n = len(self.sides)
                order = [s for s in self.sides[k % n:] + self.sides[:k % n] if s.status == "running"]
                if not order:
                    break
                self.order.append([s.name for s in order])
                for side in order:
                    self.turn(side, k, deadline)
            for side in self.sides:  # the last step done: the ranks write their results and exit
                if side.status != "running":
                    continue
                try:
                    side.exit = side.proc.wait(max(1.0, deadline - time.time()))
                    side.status = "ok" if side.exit == 0 else "error"
                    if side.exit != 0:
                        side.reason = "exit status %d after the last step" % side.exit
                except subprocess.TimeoutExpired:
                    side.status, side.reason = "timeout", "did not exit after the last step"
                    self.kill_jobs([side])
        except Timeout:
            print("multigpu: timeout (%d s) at step %d: ending every job" % (args.timeout, k), file=sys.stderr)
            for side in self.sides:
                if side.status == "running":
                    side.status, side.stopped_at = "timeout", k
                    side.reason = "the run's %d s ran out at step %d" % (args.timeout, k)
        finally:
            self.kill_jobs(self.sides)
            for side in self.sides:
                for fd in side.go:
                    os.close(fd)
                for pipe in side.done:
                    os.close(pipe.fd)
                for base in side.base:
                    for suffix in (".go", ".done"):
                        if os.path.lexists(base + suffix):
                            os.unlink(base + suffix)
        return self.report(time.time() - t_start)

    # -- the result

    def report(self, elapsed):
        sys.path.insert(0, HERE)
        from lockstep_ab import compare

        args = self.args
        sides = {}
        for side in self.sides:
            ranks = []
            for r, base in enumerate(side.base):
                try:
                    with open(base + ".json") as f:
                        worker_result = json.load(f)
                except (OSError, ValueError):
                    worker_result = None
                entry = {"rank": r, "steps": len(side.ms[r]),
                         "median_ms": round(statistics.median(side.ms[r]), 3) if side.ms[r] else None,
                         "step_ms": side.ms[r], "all_step_ms": side.all_ms[r], "losses": side.losses[r],
                         "result_file": worker_result is not None}
                for key, value in (worker_result or {}).items():
                    if key not in entry and key not in RUN_KEYS:  # the driver's own figures stay
                        entry[key] = value
                ranks.append(entry)
            if side.status == "ok" and not all(e["result_file"] for e in ranks):
                side.status, side.reason = "error", "a rank wrote no result file"
            sides[side.name] = {"status": side.status, "reason": side.reason, "stopped_at": side.stopped_at,
                                "exit": side.exit, "log": side.log, "ranks": ranks}
            if side.status not in ("ok",):
                sides[side.name]["log_tail"] = log_tail(side.log)

        comparisons, losses = {}, {}
        native = sides.get("native")
        for name, s in sides.items():
            if name == "native" or native is None:
                continue
            comp = {}
            for r in range(args.nproc):
                comp["rank%d" % r] = paired(compare, native["ranks"][r]["step_ms"], s["ranks"][r]["step_ms"], name)
            comp["job"] = paired(compare, job_ms(native), job_ms(s), name)
            comparisons[name] = comp
            losses[name] = {"rank%d" % r: loss_check(native["ranks"][r]["losses"], s["ranks"][r]["losses"])
                            for r in range(args.nproc)}

        device = next((e.get("device") for s in sides.values() for e in s["ranks"] if e.get("device")), None)
        torch_version = next((e.get("torch") for s in sides.values() for e in s["ranks"] if e.get("torch")), None)
        result = {
            "strategy": args.strategy, "workload": WORKLOADS[args.strategy], "steps": args.steps,
            "warmup": args.warmup, "varlen": args.varlen, "deterministic": args.deterministic, "seed": args.seed,
            "nproc": args.nproc, "launcher": args.launcher, "device": device, "torch": torch_version,
            "elapsed_s": round(elapsed, 1), "sides": sides, "compare": comparisons, "losses": losses,
            "order": self.order,
        }
        result["checks"] = checks(result)
        result["errored"] = [n for n, s in sides.items() if s["status"] not in ("ok", "oom")]
        return result


def paired(compare, native, other, name):
    """compare() over the timed steps both sides ran (a side that stopped early has fewer)."""
    n = min(len(native), len(other))
    if n < 2:
        return {"skipped": "fewer than 2 timed steps run by both"}
    out = compare(native[:n], other[:n], names=("native", name))
    if n < max(len(native), len(other)):
        out["partial"] = "over the first %d timed steps only (a side stopped)" % n
    return out


def job_ms(side):
    """Per timed step, the slowest rank's time: the job's step time."""
    per_rank = [e["step_ms"] for e in side["ranks"]]
    return [max(x) for x in zip(*per_rank)] if per_rank else []


def loss_check(a, b):
    """b's losses against a's (native's), step for step."""
    n = min(len(a), len(b))
    same = [a[i] == b[i] or (math.isnan(a[i]) and math.isnan(b[i])) for i in range(n)]
    diffs = [abs(a[i] - b[i]) for i in range(n) if math.isfinite(a[i]) and math.isfinite(b[i])]
    return {"steps_compared": n, "native_steps": len(a), "steps": len(b), "equal_steps": sum(same),
            "equal": n > 0 and all(same), "complete": len(a) == len(b),
            "first_difference": next((i for i in range(n) if not same[i]), None),
            "max_abs_diff": max(diffs) if diffs else None}


def checks(result):
    """The PASS/FAIL/SKIP lines: [{"check", "verdict", "detail"}]."""
    out = []
    sides = result["sides"]

    def add(check, verdict, detail):
        out.append({"check": check, "verdict": verdict, "detail": detail})

    for name, s in sides.items():
        add("run %s" % name, "PASS" if s["status"] == "ok" else "FAIL",
            "all %d steps" % (result["warmup"] + result["steps"]) if s["status"] == "ok"
            else "%s: %s" % (s["status"], s["reason"]))
    for name, s in sides.items():
        used = [e.get("allocator_used") for e in s["ranks"]]
        if None in used:
            add("allocator %s" % name, "SKIP", "no result file from every rank")
        else:
            add("allocator %s" % name, "PASS" if all(u == name for u in used) else "FAIL",
                "ranks trained with %s" % ", ".join(used))
    if "gpumem" in sides and "native" in sides:
        for key, comp in result["compare"]["gpumem"].items():
            if "skipped" in comp or "partial" in comp:
                add("speed %s" % key, "SKIP", comp.get("skipped") or comp["partial"])
                continue
            ratio, (lo, hi) = comp["ratio_of_medians"], comp["ratio_of_medians_ci95"]
            ok = ratio <= SPEED_RATIO_MAX and hi <= SPEED_CI_HIGH_MAX
            add("speed %s" % key, "PASS" if ok else "FAIL",
                "gpumem/native ratio of medians %.4f (95%% [%.4f, %.4f]) over %d steps; wanted <= %.2f, "
                "upper end <= %.2f" % (ratio, lo, hi, comp["step_pairs"], SPEED_RATIO_MAX, SPEED_CI_HIGH_MAX))
    if "gpumem" in sides:
        for other in ("native", "expandable"):
            if other not in sides:
                continue
            pairs = [(e.get("peak_reserved"), o.get("peak_reserved"))
                     for e, o in zip(sides["gpumem"]["ranks"], sides[other]["ranks"])]
            stopped = [n for n in ("gpumem", other) if sides[n]["status"] != "ok"]
            if stopped:
                add("memory vs %s" % other, "SKIP", "%s did not run to the end" % " and ".join(stopped))
                continue
            if any(g is None or o is None for g, o in pairs):
                add("memory vs %s" % other, "SKIP", "peak reserved missing for a rank")
                continue
            add("memory vs %s" % other, "PASS" if all(g < o for g, o in pairs) else "FAIL",
                "peak reserved GiB gpumem/%s per rank: %s" % (other, ", ".join(
                    "%.3f/%.3f" % (g / GIB, o / GIB) for g, o in pairs)))
    for name, per_rank in result["losses"].items():
        equal = all(c["equal"] for c in per_rank.values())
        detail = "; ".join("%s %d/%d equal, max |diff| %s%s" % (
            r, c["equal_steps"], c["steps_compared"], c["max_abs_diff"],
            "" if c["complete"] else " (native ran %d steps, %s %d)" % (c["native_steps"], name, c["steps"]))
            for r, c in per_rank.items())
        complete = all(c["complete"] and c["steps_compared"] for c in per_rank.values())
        if result["deterministic"]:
            add("losses %s = native" % name, "FAIL" if not equal and any(
                c["steps_compared"] for c in per_rank.values()) else "PASS" if complete else "SKIP", detail)
        else:
            add("losses %s = native" % name, "INFO", detail + " (not --deterministic)")
    return out


def table(result):
    """The result as text lines."""
    lines = ["multigpu %s: %d timed steps (+%d warm-up), %d ranks, varlen %s, deterministic %s; %s, torch %s; "
             "%.0f s" % (result["strategy"], result["steps"], result["warmup"], result["nproc"],
                         "on" if result["varlen"] else "off", "on" if result["deterministic"] else "off",
                         result["device"], result["torch"], result["elapsed_s"])]
    lines.append("%-11s %4s  %-10s %-15s %10s %13s %14s %6s  %s" % (
        "side", "rank", "allocator", "backend", "median ms", "peak res GiB", "peak alloc GiB", "steps", "status"))
    for name, s in result["sides"].items():
        for e in s["ranks"]:
            lines.append("%-11s %4d  %-10s %-15s %10s %13s %14s %6d  %s" % (
                name, e["rank"], e.get("allocator_used") or "?", e.get("allocator_backend") or "?",
                "%.3f" % e["median_ms"] if e["median_ms"] is not None else "-",
                "%.3f" % gib(e["peak_reserved"]) if e.get("peak_reserved") is not None else "-",
                "%.3f" % gib(e["peak_allocated"]) if e.get("peak_allocated") is not None else "-",
                e["steps"], s["status"] + (": " + s["reason"] if s["reason"] else "")))
    for name, comp in result["compare"].items():
        for key, c in comp.items():
            if "skipped" in c:
                lines.append("%s/native %-6s skipped: %s" % (name, key, c["skipped"]))
                continue
            lines.append("%s/native %-6s ratio of medians %.4f [%.4f, %.4f], geo mean %.4f [%.4f, %.4f], "
                         "%d steps%s" % (name, key, c["ratio_of_medians"], *c["ratio_of_medians_ci95"],
                                         c["geo_mean_step_ratio"], *c["step_ratio_ci95"], c["step_pairs"],
                                         " (partial)" if c.get("partial") else ""))
    for name, per_rank in result["losses"].items():
        for key, c in per_rank.items():
            if not c["steps_compared"]:
                lines.append("losses %s vs native %s: no step to compare" % (name, key))
                continue
            lines.append("losses %s vs native %s: %s, %d of %d steps equal, max |diff| %s%s" % (
                name, key, "equal" if c["equal"] else "differ", c["equal_steps"], c["steps_compared"],
                c["max_abs_diff"], "" if c["complete"] else " (the steps both ran)"))
    for c in result["checks"]:
        lines.append("%s %s %s: %s" % (c["verdict"], result["strategy"], c["check"], c["detail"]))
    for name, s in result["sides"].items():
        if s.get("log_tail"):
            lines.append("--- %s (%s) log tail, %s:" % (name, s["status"], s["log"]))
            lines.extend("    " + x for x in s["log_tail"].splitlines())
    return lines


def drive(args):
    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    bad = [x for x in sides if x not in ALLOCATORS]
    if bad or not sides or len(set(sides)) != len(sides):
        sys.exit("multigpu: --sides must be distinct names among %s (got %r)" % (", ".join(ALLOCATORS), args.sides))
    if args.nproc < 1 or args.steps < 1 or args.warmup < 0:
        sys.exit("multigpu: --nproc and --steps must be positive, --warmup not negative")
    args.sides = sides
    if args.out is None:
        args.out = os.path.join(os.getcwd(), "multigpu-" + args.strategy)

    def on_term(signum, frame):
        raise KeyboardInterrupt("signal %d" % signum)  # so that the jobs are ended on the way out

    signal.signal(signal.SIGTERM, on_term)
    result = Driver(args).run()
    lines = table(result)
    print("\n".join(lines), flush=True)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "result.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("multigpu: results in %s" % os.path.join(args.out, "result.json"), flush=True)
    if result["errored"]:
        print("multigpu: ERROR: %s did not run to the end" % ", ".join(result["errored"]), file=sys.stderr)
        return 1
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "fakerun":
        return fakerun(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="train the sides in turns and compare them",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--strategy", choices=sorted(WORKLOADS), required=True)
    r.add_argument("--sides", default=",".join(ALLOCATORS), help="comma-separated, of %s" % ", ".join(ALLOCATORS))
    r.add_argument("--steps", type=int, default=40, help="timed steps")
    r.add_argument("--warmup", type=int, default=6, help="steps before the timed ones")
    r.add_argument("--varlen", action="store_true", help="a sequence length per step, drawn from %s"
                   % ", ".join("%s %s" % (k, list(v["varlen"])) for k, v in WORKLOADS.items()))
    r.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms: every side's losses must equal native's, step for step")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=None, help="results directory (default ./multigpu-STRATEGY)")
    r.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) per side")
    r.add_argument("--timeout", type=float, default=540, help="seconds for the whole run (default 540)")
    r.add_argument("--launcher", choices=("torchrun", "fake"), default="torchrun",
                   help="fake: a dry run of the turn protocol, sleeping instead of training (no torch, no GPU)")
    w = sub.add_parser("worker", help="one rank of one side (started by run under torchrun)")
    w.add_argument("--strategy", choices=sorted(WORKLOADS), required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--warmup", type=int, required=True)
    w.add_argument("--turns", required=True, help="the directory of the FIFOs")
    w.add_argument("--side", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--varlen", action="store_true")
    w.add_argument("--deterministic", action="store_true")
    w.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode == "worker":
        return worker(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
