"""gpumem.predict for several GPUs, on the CPU: one rank of a DDP or FSDP2
job recorded on fake CUDA tensors with PyTorch's fake process group
(gpumem.predict.distributed) holds, on each rank, exactly the parameter,
gradient and optimizer-state bytes its shards have at world sizes 2, 4 and
8, uneven shards included (FSDP2 pads every shard to ceil(rows / ranks)
rows; the last ranks hold fewer rows or none); FSDP2's all-gather outputs,
on its all-gather stream, are each unit's unsharded (padded) parameter
bytes, in forward order and again in reverse in the backward, with
activation checkpointing and with CPUOffloadPolicy too; DDP's gradient
bucket is the parameters' bytes. Streams, record_stream and storages
resized in place are recorded; the command runs a torchrun script at
several world sizes end to end. Needs PyTorch (the CPU build will do);
the Llama test needs transformers."""

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

try:
    import torch
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    torch = None
try:
    import transformers
except ImportError:  # pragma: no cover
    transformers = None

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYTHON_DIR)
JOB = os.path.join(REPO, "bench", "torch", "fsdp_job.py")
sys.path.insert(0, PYTHON_DIR)

from gpumem import _cli  # noqa: E402
from gpumem.predict import distributed, profiles  # noqa: E402

NO_TORCH = "needs PyTorch (pip install torch: the CPU build will do)"
NO_DIST = "needs torch.distributed and FSDP2 (torch.distributed.fsdp.fully_shard)"
F32 = 4
DIMS = (16, 33, 8, 6)  # Linear 16->33 (33 rows: uneven over 2, 4, 8), 33->8 (even), 8->6 (uneven, empty shards at 8)


def have_fsdp2():
    if torch is None or not dist.is_available():
        return False
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError:
        return False
    return True


# ---- what each rank must hold, from torch.chunk's rule (not from the recorder) ----


def rows(size, world, rank):
    """Rows of a dimension of `size` that rank holds of world shards."""
    chunk = -(-size // world)
    return max(0, min(chunk, size - rank * chunk))


def padded_rows(size, world):
    return -(-size // world)


def mlp():
    class Block(torch.nn.Module):
        def __init__(self, d_in, d_out, last):
            super().__init__()
            self.linear = torch.nn.Linear(d_in, d_out)
            self.last = last

        def forward(self, x):
            y = self.linear(x)
            return y if self.last else torch.relu(y)

    class Net(torch.nn.Module):
        def __init__(self, checkpointing=False):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block(DIMS[i], DIMS[i + 1], i == len(DIMS) - 2)
                                              for i in range(len(DIMS) - 1))  # fmt: skip
            self.checkpointing = checkpointing

        def forward(self, x):
            for layer in self.layers:
                if self.checkpointing:
                    x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
                else:
                    x = layer(x)
            return x

    return Net


def unit_shapes():
    """Each layer's parameters' shapes (weight, bias): one FSDP unit each."""
    return [[(DIMS[i + 1], DIMS[i]), (DIMS[i + 1],)] for i in range(len(DIMS) - 1)]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def shard_bytes(shape, world, rank, elt=F32):
    return rows(shape[0], world, rank) * numel(shape[1:]) * elt


def padded_shard_bytes(shape, world, elt=F32):
    return padded_rows(shape[0], world) * numel(shape[1:]) * elt


def padded_unsharded_bytes(shapes, world, elt=F32):
    return sum(padded_rows(s[0], world) * world * numel(s[1:]) * elt for s in shapes)


class Job:
    """A small job recorded as one rank of `world` in this process."""

    def __init__(self, strategy, world, rank, steps=2, batch=4, checkpointing=False, offload=False, bf16=False):
        from gpumem.predict.recorder import recording

        self.world, self.rank = world, rank
        self.marks = {}
        with recording(None, "h200", workload="job") as rec:
            with distributed.session(rec, distributed.child_env({}, rank, world)):
                dist.init_process_group("nccl")
                model = mlp()(checkpointing).to("cuda:%d" % rank)
                self.marks["wrap"] = len(rec.events)
                if strategy == "fsdp2":
                    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

                    kw = {}
                    if offload:
                        kw["offload_policy"] = CPUOffloadPolicy()
                    if bf16:
                        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                    for layer in model.layers:
                        fully_shard(layer, **kw)
                    fully_shard(model, **kw)
                else:
                    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
                self.marks["wrapped"] = len(rec.events)
                opt = torch.optim.AdamW(model.parameters())
                for step in range(steps + 1):
                    x = torch.randn(batch, DIMS[0], device="cuda")
                    y = torch.randint(0, DIMS[-1], (batch,), device="cuda")
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    if step < steps:
                        opt.zero_grad(set_to_none=True)
                # after the last step: gradients and state alive, read them here
                self.read(rec, model, opt, strategy)
        self.rec = rec
        self.lines = rec.lines()

    def read(self, rec, model, opt, strategy):
        sizes = {e[1]: e[2] for e in rec.events if e[0] == "a"}

        def held(t):
            """(bytes of the CUDA allocation under t, or None, its rows)."""
            local = t.to_local() if hasattr(t, "to_local") else t
            i = rec.storages.get(local.untyped_storage()._cdata) if local.device.type == "cuda" else None
            return (sizes[i] if i is not None else None), (local.shape[0] if local.dim() else 0), i

        params = list(model.parameters())
        self.params = [held(p) for p in params]
        self.grads = [held(p.grad) for p in params]
        self.state = [[held(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")] for p in params]
        self.live = dict(rec._live)
        self.sizes = sizes
        if strategy == "fsdp2":
            self.unsharded = []
            for layer in model.layers:
                for fp in layer._get_fsdp_state()._fsdp_param_group.fsdp_params:
                    s = fp._unsharded_param.untyped_storage()
                    self.unsharded.append((s.nbytes(), s._cdata in rec.storages))
            ctx = model.layers[0]._get_fsdp_state()._comm_ctx
            self.streams = {k: getattr(ctx, k).stream_id for k in ("all_gather_copy_in_stream", "all_gather_stream",
                                                                   "reduce_scatter_stream")}  # fmt: skip

    def step_events(self, step):
        """The events of training step `step` (1-based)."""
        ev = self.rec.events
        marks = [i for i, e in enumerate(ev) if e[0] == "s"]
        start = marks[step - 2] + 1 if step > 1 else 0
        return ev[start:marks[step - 1]]

    def on_stream(self, step, stream):
        return [e[2] for e in self.step_events(step) if e[0] == "a" and e[3] == stream]


@unittest.skipIf(not have_fsdp2(), NO_TORCH if torch is None else NO_DIST)
class Fsdp2Test(unittest.TestCase):
    WORLDS = (2, 4, 8)

    def ranks(self, world):
        """Rank 0, the last, and each rank whose shards differ from both."""
        want = {0, world - 1}
        seen = {}
        for r in range(world):
            key = tuple(rows(s[0], world, r) for u in unit_shapes() for s in u)
            seen.setdefault(key, r)
        return sorted(want | set(seen.values()))

    def check_shards(self, job, offload=False):
        w, r = job.world, job.rank
        shapes = [s for u in unit_shapes() for s in u]
        for (nbytes, local_rows, _), shape in zip(job.params, shapes):
            # the rank's view has its rows; the storage under it is FSDP2's padded shard,
            # the same on every rank
            self.assertEqual(local_rows, rows(shape[0], w, r))
            self.assertEqual(nbytes, None if offload else padded_shard_bytes(shape, w))
        # gradients: one reduce-scatter output a unit (the unit's padded shards), each
        # parameter's gradient a view of its rows
        by_unit = [job.grads[2 * k:2 * k + 2] for k in range(len(unit_shapes()))]
        for grads, shapes_u in zip(by_unit, unit_shapes()):
            for (nbytes, local_rows, _), shape in zip(grads, shapes_u):
                self.assertEqual(local_rows, rows(shape[0], w, r))
                self.assertEqual(nbytes, None if offload else sum(padded_shard_bytes(s, w) for s in shapes_u))
            if not offload:
                self.assertEqual(grads[0][2], grads[1][2], "one allocation under the unit's gradients")
        # AdamW's two moments: exactly the rank's rows, none where it holds no rows
        for state, shape in zip(job.state, shapes):
            for nbytes, local_rows, _ in state:
                expect = shard_bytes(shape, w, r)
                self.assertEqual(nbytes, None if offload or expect == 0 else expect)
        # the per-rank totals, as a user reads them
        if not offload:
            self.assertEqual(sum(n for n, _, _ in job.params), sum(padded_shard_bytes(s, w) for s in shapes))
            state = sum(n or 0 for st in job.state for n, _, _ in st)
            self.assertEqual(state, 2 * sum(shard_bytes(s, w, r) for s in shapes))

    def check_all_gathers(self, job, elt=F32):
        """Each step all-gathers every unit into an output of its unsharded
        (padded) bytes on the copy-in stream, in forward order, then again in
        reverse for the backward (each unit was resharded after its forward);
        the reduce-scatter outputs, on the reduce-scatter stream, are the
        units' padded shards, last unit first."""
        w = job.world
        units = [padded_unsharded_bytes(u, w, elt) for u in unit_shapes()]
        gathered = job.on_stream(2, job.streams["all_gather_copy_in_stream"])
        if elt == F32:
            self.assertEqual(gathered, units + units[::-1])
        else:  # (mixed precision: the bf16 outputs after the CPU offload's copies, if any)
            self.assertEqual([g for g in gathered if g in units], units + units[::-1])
        for u, shapes in zip(units, unit_shapes()):
            if all(s[0] % w == 0 for s in shapes):
                self.assertEqual(u, sum(numel(s) for s in shapes) * elt, "an even unit: its unsharded bytes")
        scattered = job.on_stream(2, job.streams["reduce_scatter_stream"])
        self.assertEqual(scattered, [sum(padded_shard_bytes(s, w) for s in u) for u in unit_shapes()][::-1])
        # nothing on the all-gather stream itself: NCCL writes into the outputs made on the copy-in stream
        self.assertEqual(job.on_stream(2, job.streams["all_gather_stream"]), [])

    def check_resharded(self, job):
        """The unsharded parameters live only while their unit computes: after
        the backward each one's storage is resized to nothing (FSDP2's
        reshard), and no allocation of the recording is under it."""
        self.assertTrue(job.unsharded)
        for nbytes, live in job.unsharded:
            self.assertEqual((nbytes, live), (0, False))

    def test_shards_gradients_and_state_at_2_4_8(self):
        for w in self.WORLDS:
            for r in self.ranks(w):
                with self.subTest(world=w, rank=r):
                    job = Job("fsdp2", w, r)
                    self.check_shards(job)
                    self.check_all_gathers(job)
                    self.check_resharded(job)

    def test_ranks_differ_only_where_shards_do(self):
        """Rank 0 and the last rank make the same requests in the same order
        but for their optimizer state, whose sizes are their rows'; at 8
        ranks the 8->6 layer's last two ranks hold no rows and make no
        allocation for them."""
        a, b = Job("fsdp2", 2, 0), Job("fsdp2", 2, 1)
        ka = [(e[0], e[2] if e[0] == "a" else None) for e in a.rec.events]
        kb = [(e[0], e[2] if e[0] == "a" else None) for e in b.rec.events]
        self.assertEqual(len(ka), len(kb))
        diff = [(x[1], y[1]) for x, y in zip(ka, kb) if x != y]
        self.assertEqual(sorted(set(diff)), [(17 * 4, 16 * 4), (17 * 16 * 4, 16 * 16 * 4)])
        last = Job("fsdp2", 8, 7)
        self.assertEqual([n for n, _, _ in last.state[4]], [None, None])  # the 8->6 weight: no rows on rank 7
        classes = distributed.rank_classes(8, [(s[0], 8) for u in unit_shapes() for s in u])
        self.assertEqual(classes, [[0, 1, 2, 3, 4, 5], [6], [7]])

    def test_activation_checkpointing(self):
        for w in self.WORLDS:
            with self.subTest(world=w):
                job = Job("fsdp2", w, w - 1, checkpointing=True)
                self.check_shards(job)
                self.check_all_gathers(job)
                plain = Job("fsdp2", w, w - 1)
                # the forward's activations (batch x 33 fp32) are made again in the backward
                act = 4 * 33 * F32
                count = lambda j: sum(1 for e in j.step_events(2) if e[0] == "a" and e[2] == act)  # noqa: E731
                self.assertGreater(count(job), count(plain))

    def test_cpu_offload(self):
        for w in self.WORLDS:
            with self.subTest(world=w):
                job = Job("fsdp2", w, 0, offload=True)
                # parameters, gradients and AdamW's state on the CPU: no CUDA allocation under them
                self.check_shards(job, offload=True)
                # each unit's shards copied to the GPU on the copy-in stream, then all-gathered
                w_ = job.world
                copied = job.on_stream(2, job.streams["all_gather_copy_in_stream"])
                forward = []
                for u in unit_shapes():
                    forward += [padded_shard_bytes(s, w_) for s in u] + [padded_unsharded_bytes(u, w_)]
                self.assertEqual(copied[:len(forward)], forward)

    def test_mixed_precision_all_gathers_bf16(self):
        """With bf16 parameters for compute each unit's shards are cast on the
        copy-in stream, then all-gathered into an output of the unit's
        unsharded bf16 bytes."""
        job = Job("fsdp2", 4, 0, bf16=True)
        self.check_shards(job)
        per_unit = [[sum(padded_shard_bytes(s, 4, 2) for s in u), padded_unsharded_bytes(u, 4, 2)]
                    for u in unit_shapes()]  # fmt: skip
        gathered = job.on_stream(2, job.streams["all_gather_copy_in_stream"])
        self.assertEqual(gathered, sum(per_unit + per_unit[::-1], []))


@unittest.skipIf(not have_fsdp2(), NO_TORCH if torch is None else NO_DIST)
class DdpTest(unittest.TestCase):
    def test_full_copies_and_one_bucket_at_2_4_8(self):
        shapes = [s for u in unit_shapes() for s in u]
        total = sum(numel(s) for s in shapes) * F32
        events = None
        for w in (2, 4, 8):
            for r in (0, w - 1):
                with self.subTest(world=w, rank=r):
                    job = Job("ddp", w, r)
                    self.assertEqual([n for n, _, _ in job.params], [numel(s) * F32 for s in shapes])
                    self.assertEqual([n for n, _, _ in job.grads], [numel(s) * F32 for s in shapes])
                    self.assertEqual([[n for n, _, _ in st] for st in job.state], [[numel(s) * F32] * 2 for s in shapes])
                    # DDP's constructor: the broadcast's flat copy of the parameters, then the gradient
                    # bucket (one, below the first bucket's 1 MiB), both the parameters' bytes
                    made = job.rec.events[job.marks["wrap"]:job.marks["wrapped"]]
                    self.assertEqual([e[2] for e in made if e[0] == "a"], [total, total])
                    # rebuilt in the order gradients came after the first step: at the end one
                    # bucket is alive besides the parameters, gradients and state
                    under = {i for t in job.params + job.grads + [x for st in job.state for x in st] for i in [t[2]]}
                    others = [n for i, n in job.live.items() if i not in under and n == total]
                    self.assertEqual(others, [total])
                    # every rank of every world size makes the same requests
                    mine = [e for e in job.rec.events]
                    if events is None:
                        events = mine
                    self.assertEqual(mine, events)


@unittest.skipIf(not have_fsdp2(), NO_TORCH if torch is None else NO_DIST)
class SessionTest(unittest.TestCase):
    def record(self, body, world=2, rank=0):
        from gpumem.predict.recorder import recording

        with recording(None, "h200", workload="job") as rec:
            with distributed.session(rec, distributed.child_env({}, rank, world)):
                dist.init_process_group("nccl")
                body(rec)
        return rec

    def test_streams_and_record_stream(self):
        def body(rec):
            side = torch.cuda.Stream()
            a = torch.empty(100, device="cuda")
            with torch.cuda.stream(side):
                b = torch.empty(200, device="cuda")
                self.assertIs(torch.cuda.current_stream(), side)
            self.assertIsNot(torch.cuda.current_stream(), side)
            a.record_stream(side)
            del a, b

        # (an allocation's role, its fifth field, left out)
        lines = [" ".join(l.split()[:4]) for l in self.record(body).lines() if not l.startswith("#")]
        self.assertEqual(lines, ["a 0 400 0", "a 1 800 1", "r 0 1", "f 0", "f 1"])

    def test_storage_resized_in_place(self):
        def body(rec):
            t = torch.empty(64, device="cuda")
            t.untyped_storage().resize_(0)
            t.untyped_storage().resize_(256)
            t.untyped_storage().resize_(512)
            del t

        lines = [" ".join(l.split()[:4]) for l in self.record(body).lines() if not l.startswith("#")]
        # resized to nothing: freed; from nothing: allocated; to another size: the new block first
        self.assertEqual(lines, ["a 0 256 0", "f 0", "a 1 256 0", "a 2 512 0", "f 1", "f 2"])

    def test_init_process_group_is_the_fake_group(self):
        seen = {}

        def body(rec):
            seen["backend"] = dist.get_backend()
            seen["rank"], seen["world"] = dist.get_rank(), dist.get_world_size()

        rec = self.record(body, world=4, rank=3)
        self.assertEqual(seen, {"backend": "fake", "rank": 3, "world": 4})
        self.assertTrue(any("fake group" in n for n in rec.notes))
        self.assertFalse(dist.is_initialized(), "the session destroys the group it made")

    def test_wrong_rank_is_refused(self):
        from gpumem.predict.recorder import RecorderError, recording

        with self.assertRaisesRegex(RecorderError, "rank 1 of world size 2, but this recording is rank 0 of 4"):
            with recording(None, "h200") as rec:
                with distributed.session(rec, distributed.child_env({}, 0, 4)):
                    dist.init_process_group("nccl", rank=1, world_size=2)

    def test_environment(self):
        env = distributed.child_env({"PATH": "/bin"}, 2, 8)
        self.assertEqual((env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]), ("2", "8", "2"))
        self.assertTrue(distributed.wanted(env))
        self.assertEqual(distributed.rank_and_world(env), (2, 8, 8))
        with self.assertRaises(ValueError):
            distributed.child_env({}, 8, 8)


@unittest.skipIf(torch is None, NO_TORCH)
class NcclFiguresTest(unittest.TestCase):
    def profile(self, values):
        return profiles.Profile({"name": "p", "gpu": "G", "values": values})

    def test_each_figure_says_where_it_comes_from(self):
        p = self.profile({
            "nccl_communicator_bytes_1rank": {"value": 100, "source": "measured", "why": "measured on G; more"},
            "nccl_communicator_bytes_2ranks": {"value": 200, "source": "estimate", "why": "a report"},
        })  # fmt: skip
        total, lines = distributed.nccl_bytes(p, [1])
        self.assertEqual((total, lines), (100, [("NCCL, 1 communicator of 1 rank", 100,
                                                  "measured (nccl_communicator_bytes_1rank)")]))  # fmt: skip
        total, lines = distributed.nccl_bytes(p, [2, 2])
        self.assertEqual(total, 400)
        self.assertEqual(lines[0][2], "assumed (nccl_communicator_bytes_2ranks)")
        notes = distributed.nccl_notes(p, [{"communicators": [2]}, {"communicators": [8]}])
        self.assertEqual(notes[0], "nccl_communicator_bytes_2ranks, assumed: a report")
        self.assertIn("nccl_communicator_bytes_nranks is not in the device profile", notes[1])
        total, lines = distributed.nccl_bytes(p, [8])
        self.assertEqual(total, 0)
        self.assertIn("not in the device profile (nccl_communicator_bytes_nranks): not counted", lines[0][2])
        self.assertEqual(distributed.nccl_bytes(p, []), (0, []))

    def test_shipped_profile_names_its_nccl_figures(self):
        p = profiles.load("h200")
        for _, key in distributed.NCCL_KEYS:
            self.assertIn(key, p.values)
            self.assertTrue(p.values[key]["why"])
        # the single-GPU notes do not list what only several GPUs use
        self.assertNotIn("nccl", p.notes()[0])


def _binary():
    return _cli.find()


@unittest.skipIf(not have_fsdp2(), NO_TORCH if torch is None else NO_DIST)
class CommandTest(unittest.TestCase):
    def run_command(self, *args, timeout=900):
        env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
        return subprocess.run([sys.executable, "-m", "gpumem.predict"] + list(args), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)  # fmt: skip

    def test_usage_errors(self):
        job = [JOB, "--strategy", "fsdp2", "--batch-size", "{B}"]
        for opts, message in (
            (["--gpus", "0,2"], "bad --gpus '0,2'"),
            (["--gpus", "two"], "bad --gpus 'two'"),
            (["--global-batch", "64"], "--global-batch needs --gpus"),
            (["--gpus", "2", "--global-batch", "0"], "--global-batch must be at least 1"),
            (["--gpus", "2", "--seq-lens", "8,16", "--seq-len", "32"], "--gpus does not take --seq-lens"),
        ):
            with self.subTest(opts=opts):
                extra = ["--seq-len", "{L}"] if "--seq-lens" in opts else []
                done = self.run_command("--memory", "1G", *opts, *job, *extra, timeout=60)
                self.assertEqual(done.returncode, 2, done.stderr)
                self.assertIn(message, done.stderr.decode())

    def ddp_script_at_2_gpus(self, setup, layer, step):
        """A DDP script of one nn.<layer> trained by SGD for three steps,
        `setup` run before its process group and `step` (the forward and
        backward) each step, predicted at 2 GPUs from batch 1 and 2: the
        finished command."""
        script = (
            "import argparse, os, torch, torch.distributed as dist\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); a = p.parse_args()\n"
            "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n" + setup +
            "dist.init_process_group('nccl')\n"
            "m = torch.nn.parallel.DistributedDataParallel(torch.nn.%s.cuda())\n"
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "for step in range(3):\n" % layer + step +
            "    opt.step(); opt.zero_grad()\n"
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "train.py")
            with open(path, "w") as f:
                f.write(script)
            return self.run_command("--gpus", "2", "--memory", "4G", "--batch-sizes", "1,2", "--no-confirm", path,
                                    "--batch-size", "{B}")  # fmt: skip

    @unittest.skipIf(_binary() is None, "needs the gpumem command line program (make build)")
    def test_a_size_in_the_square_of_the_batch_is_said_per_rank(self):
        # a contrastive loss's batch-by-batch logits under DDP: a line through two recordings
        # puts them far too low; one GPU records a third batch, here each rank's line says so
        done = self.ddp_script_at_2_gpus(
            "", "Linear(64, 32)",
            "    z = m(torch.randn(a.batch_size, 64, device='cuda'))\n"
            "    torch.nn.functional.cross_entropy(z @ z.t(), torch.arange(a.batch_size, device='cuda')).backward()\n")
        self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
        self.assertIn("2 GPUs, rank 0: ", done.stdout.decode())
        self.assertIn("grew faster than the batch from 1 to 2 (nearer its square than a line), taken as lines, "
                      "far too low at a large batch: give three batch sizes (--batch-sizes 1,2,4)",
                      done.stdout.decode())

    @unittest.skipIf(_binary() is None, "needs the gpumem command line program (make build)")
    def test_a_script_that_caps_pytorch_is_answered_under_its_cap(self):
        # set_per_process_memory_fraction caps what each rank's caching allocator reserves at
        # that share of the whole device: the table answers for that, not for what the context
        # and NCCL leave
        done = self.ddp_script_at_2_gpus(
            "torch.cuda.set_per_process_memory_fraction(0.25)\n", "Linear(256, 256)",
            "    m(torch.randn(a.batch_size, 256, device='cuda')).square().sum().backward()\n")
        out = done.stdout.decode()
        self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
        self.assertIn("the script caps PyTorch at 0.25 of the device (torch.cuda.set_per_process_memory_fraction): "
                      "the table answers for 1.000 GiB", out)  # fmt: skip
        self.assertNotIn("left to the allocator", out)

    def test_fsdp2_script_at_2_and_4_gpus(self):
        with tempfile.TemporaryDirectory() as d:
            done = self.run_command("--gpus", "2,4", "--memory", "4G", "--batch-sizes", "2,4", "--batch", "64",
                                    "--global-batch", "4096", "--no-confirm", "--traces", d,
                                    JOB, "--strategy", "fsdp2", "--batch-size", "{B}")  # fmt: skip
            out = done.stdout.decode()
            self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
            self.assertIn("2 GPUs: rank 0; rank 1", out)
            # at 4 ranks: ranks 0-2 hold full shards of every layer (the 8->6 layer's 2 rows each
            # for 0-2, none for 3)
            self.assertIn("4 GPUs: ranks 0-2 alike (rank 0 recorded); rank 3", out)
            self.assertIn("NCCL, 1 communicator of 2 ranks: 0.531 GiB, assumed (nccl_communicator_bytes_2ranks)", out)
            self.assertIn("NCCL, 1 communicator of 4 ranks: 0.672 GiB, assumed (nccl_communicator_bytes_nranks)", out)
            self.assertIn("  - nccl_communicator_bytes_nranks, assumed: a third party's figure", out)
            self.assertIn("fewest GPUs for a global batch of 4096", out)
            # the table's figures are gpumem predict's on the recordings, the budget less the
            # context and NCCL
            rank0 = [os.path.join(d, "gpus4", "rank0", "b%d" % b, "trace") for b in (2, 4)]
            rank3 = [os.path.join(d, "gpus4", "rank3", "b%d" % b, "trace") for b in (2, 4)]
            p = profiles.load("h200")
            budget = (4 << 30) - p.value("cuda_context_bytes") - p.value("nccl_communicator_bytes_nranks")
            rows = {}
            for paths in (rank0, rank3):
                got = subprocess.run([_binary(), "predict", "--sizes", "2,4"] + paths
                                     + ["--memory", "%dB" % budget, "--batch", "64", "--json"],
                                     stdout=subprocess.PIPE, check=True)  # fmt: skip
                for r in json.loads(got.stdout)["allocators"]:
                    old = rows.get(r["allocator"])
                    if old is None or r["largest_batch"] < old["largest_batch"]:
                        rows[r["allocator"]] = r
            block = out.split("\n4 GPUs:")[1].split("\n\n")[0]
            for name, r in rows.items():
                m = re.search(r"^\s+%s\s+(\d+)" % re.escape(name), block, re.M)
                self.assertIsNotNone(m, name)
                self.assertEqual(int(m.group(1)), r["largest_batch"], name)


@unittest.skipIf(not have_fsdp2() or transformers is None, "needs PyTorch with FSDP2 and transformers")
class LlamaTest(unittest.TestCase):
    WORLD = 4

    def record(self, offload):
        """A tiny Llama built on the meta device, sharded per decoder layer,
        materialised with to_empty (on the host with CPUOffloadPolicy) and
        initialised, trained two steps with bf16 parameters for compute."""
        sys.path.insert(0, os.path.dirname(JOB))
        import fsdp_job
        from gpumem.predict.recorder import recording
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        out = {}
        with recording(None, "h200", workload="llama") as rec:
            with distributed.session(rec, distributed.child_env({}, 0, self.WORLD)):
                dist.init_process_group("nccl")
                model = fsdp_job.build_llama(torch, "llama-tiny", False)
                kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
                if offload:
                    kw["offload_policy"] = CPUOffloadPolicy()
                for layer in model.model.layers:
                    fully_shard(layer, **kw)
                fully_shard(model, **kw)
                model.to_empty(device="cpu" if offload else "cuda")
                fsdp_job.init_llama(torch, model)
                opt = torch.optim.AdamW(model.parameters())
                ids = torch.randint(0, 256, (2, 32)).cuda()
                for _ in range(2):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                sizes = {e[1]: e[2] for e in rec.events if e[0] == "a"}
                out["params"] = []
                for p in model.parameters():
                    local = p.to_local()
                    i = rec.storages.get(local.untyped_storage()._cdata)
                    out["params"].append((local.device.type, None if i is None else sizes[i],
                                          padded_rows(p.shape[0], self.WORLD) * numel(p.shape[1:]) * F32))  # fmt: skip
                out["copy_in"] = model.model.layers[0]._get_fsdp_state()._comm_ctx.all_gather_copy_in_stream.stream_id
                out["layer_bytes"] = sum(padded_rows(p.shape[0], self.WORLD) * self.WORLD * numel(p.shape[1:]) * 2
                                         for p in model.model.layers[0].parameters())  # fmt: skip
        marks = [i for i, e in enumerate(rec.events) if e[0] == "s"]
        step2 = rec.events[marks[0] + 1:marks[1]]
        out["gathered"] = [e[2] for e in step2 if e[0] == "a" and e[3] == out["copy_in"]]
        return out

    def test_meta_init_shards_each_layer(self):
        """Each rank's parameters are its padded shards, and each layer's
        all-gather output is its parameters' unsharded bf16 bytes, in the
        forward and again in the backward."""
        out = self.record(offload=False)
        for device, nbytes, expect in out["params"]:
            self.assertEqual((device, nbytes), ("cuda", expect))
        self.assertEqual(out["gathered"].count(out["layer_bytes"]), 2 * 2, "each of 2 layers, forward and backward")

    def test_meta_init_on_the_host(self):
        """With CPUOffloadPolicy the shards stay on the host (no CUDA
        allocation under them: DTensor's random initialisation of host shards
        included) and the layers are all-gathered on the GPU as before."""
        out = self.record(offload=True)
        for device, nbytes, _ in out["params"]:
            self.assertEqual((device, nbytes), ("cpu", None))
        self.assertEqual(out["gathered"].count(out["layer_bytes"]), 2 * 2)


if __name__ == "__main__":
    unittest.main()
