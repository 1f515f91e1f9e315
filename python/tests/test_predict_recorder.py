"""gpumem.predict on the CPU: the recorder's traces of small models run on
fake CUDA tensors are well formed (every free names a live allocation,
one '# step N' a step), hold the sizes known tensors must have
(parameters, AdamW's two moments, gradients, activations that double
with the batch) and the order a hand-worked step has; models built before
the recording, called twice, or reading values in their constructor are
recorded; the command runs a script end to end. Needs PyTorch (the CPU
build will do); the transformers models need transformers."""

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None
try:
    import transformers
except ImportError:  # pragma: no cover
    transformers = None

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
sys.path.insert(0, PYTHON_DIR)

from gpumem import _cli  # noqa: E402
from gpumem.predict import __main__ as command  # noqa: E402
from gpumem.predict import profiles  # noqa: E402

NO_TORCH = "needs PyTorch (pip install torch: the CPU build will do)"
WORKSPACE = 32 << 20
LT_WORKSPACE = 1 << 20


def parse(lines):
    """(allocs {id: size}, frees [id], steps, notes) of a trace's lines,
    checking it is well formed: frees name live allocations, ids are not
    reused while live, steps count up from 1."""
    live, allocs, frees, steps, notes = {}, {}, [], 0, []
    for line in lines:
        if line.startswith("# step "):
            steps += 1
            assert int(line.split()[2]) == steps, line
        elif line.startswith("# note: "):
            notes.append(line[8:])
        elif line.startswith("#"):
            continue
        elif line.startswith("a "):
            _, i, size, stream = line.split()[:4]  # (then the role, if any)
            assert i not in live, "id %s allocated while live" % i
            assert int(size) > 0 and stream == "0", line
            live[i] = int(size)
            allocs[int(i)] = int(size)
        elif line.startswith("f "):
            i = line.split()[1]
            assert i in live, "free of %s, not live" % i
            del live[i]
            frees.append(int(i))
        else:
            raise AssertionError("bad line %r" % line)
    return allocs, frees, steps, notes


def mlp(d_in=16, hidden=32, d_out=4):
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))


def mlp_batch(n, d_in=16, d_out=4):
    return (torch.randn(n, d_in), torch.randint(0, d_out, (n,)))


def mlp_step(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


@unittest.skipIf(torch is None, NO_TORCH)
class RecorderTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from gpumem.predict import record_step

        cls.record_step = staticmethod(record_step)

    def record(self, *args, **kwargs):
        rec = self.record_step(*args, **kwargs)
        allocs, frees, steps, notes = parse(rec.lines())
        self.assertEqual(steps, kwargs.get("steps", 3))
        self.assertEqual(notes, rec.notes)
        return rec, allocs, frees

    def test_mlp_step_by_hand(self):
        """The first step of a 16-32-4 MLP with AdamW, allocation by
        allocation, as the caching allocator sees it (fp32, batch 2)."""
        rec, allocs, frees = self.record(mlp, mlp_batch, mlp_step, batch_size=2, steps=2)
        seq = [e for e in rec.events]
        sizes = [e[2] for e in seq if e[0] == "a"]
        # parameters (W1, b1, W2, b2), then the batch (x fp32, y int64)
        self.assertEqual(sizes[:6], [16 * 32 * 4, 32 * 4, 32 * 4 * 4, 4 * 4, 2 * 16 * 4, 2 * 8])
        # forward: addmm (2x32), cuBLAS's workspace at the first matmul and cuBLASLt's
        # (the bias goes through its epilogue), relu (2x32)
        self.assertEqual(sizes[6:10], [2 * 32 * 4, WORKSPACE, LT_WORKSPACE, 2 * 32 * 4])
        # the addmm's output dies at once: relu saves its own output
        first_free = next(e for e in seq if e[0] == "f")
        self.assertEqual(first_free[1], 6)
        # AdamW's state: exp_avg and exp_avg_sq per parameter, never freed
        p_sizes = sizes[:4]
        state = [a for a in rec.allocations() if not a[2] and a[1] in p_sizes and a[0] > 8]
        self.assertEqual(sorted(s for _, s, _ in state), sorted(p_sizes * 2))
        # a second workspace for the backward's matmuls, then no more; the backward
        # sums its bias gradients, so no second cuBLASLt workspace
        self.assertEqual(sizes.count(WORKSPACE), 2)
        self.assertEqual(sizes.count(LT_WORKSPACE), 1)
        # live at the end: parameters, moments, workspaces (gradients freed by zero_grad)
        self.assertEqual(rec.live_bytes, 3 * sum(p_sizes) + 2 * WORKSPACE + LT_WORKSPACE)

    def test_matches_the_real_cpu_run(self):
        """Ground truth: the same two steps run for real on the CPU under
        torch.profiler's memory profiling (AdamW foreach, as on CUDA).
        Apart from events of 8 bytes or less (AdamW's step counters and
        the scalars computed from them, CPU tensors on a GPU too, and the
        4-byte loss), the allocations and frees come in the same order
        at the same sizes."""

        def build():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                       torch.nn.GELU(), torch.nn.Linear(256, 10))  # fmt: skip

        self.assert_matches_real_run(build, d_in=64, d_out=10)

    def test_gradients_summed_in_place_as_on_the_gpu(self):
        """A tensor used twice gets two gradients, which autograd's engine
        sums in place into the first (on the GPU as on the CPU, for plain
        tensors; fake ones it would sum into a new tensor): the recording
        has the real run's allocations, no more."""

        class Residual(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inp, self.mid, self.out = (torch.nn.Linear(64, 256), torch.nn.Linear(256, 256),
                                                torch.nn.Linear(256, 10))  # fmt: skip

            def forward(self, x):
                h = self.inp(x)
                h = h + self.mid(torch.relu(h))
                return self.out(torch.tanh(h) + h)

        def build():
            torch.manual_seed(0)
            return Residual()

        self.assert_matches_real_run(build, d_in=64, d_out=10)

    def assert_matches_real_run(self, build, d_in, d_out):
        from torch.profiler import ProfilerActivity, profile

        def batch(n):
            return mlp_batch(n, d_in=d_in, d_out=d_out)

        model = build()
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        data = [batch(8) for _ in range(2)]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for b in data:
                loss = mlp_step(model, b)
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
        results = getattr(prof.profiler, "kineto_results", None)
        if results is None or not hasattr(results, "events"):
            self.skipTest("this torch.profiler gives no memory events")
        mem = sorted((e for e in results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
        real = [("a", e.nbytes()) if e.nbytes() > 0 else ("f", -e.nbytes()) for e in mem]

        rec = self.record_step(build, batch, mlp_step, batch_size=8, steps=2, device_profile="none")
        sizes, ours = {}, []
        for e in rec.events:
            if e[0] == "a":
                sizes[e[1]] = e[2]
            if e[0] in "af":
                ours.append((e[0], sizes[e[1]]))
        x_bytes, y_bytes = 8 * d_in * 4, 8 * 8  # the batch, made before the real run's profiling
        ours = ours[ours.index(("a", x_bytes)):]

        def comparable(seq):
            return [e for e in seq if e[1] > 8 and e[1] not in (x_bytes, y_bytes)]

        self.assertEqual(comparable(real), comparable(ours))
        self.assertGreater(len(comparable(ours)), 100)

    def test_gradients_live_from_backward_to_zero_grad(self):
        rec, allocs, frees = self.record(mlp, mlp_batch, mlp_step, batch_size=2, steps=2)
        ev = rec.events
        step1 = ev.index(("s", 1))
        # zero_grad(set_to_none=True) right after the step frees the four gradients
        after = ev[step1 + 1 : step1 + 5]
        self.assertTrue(all(e[0] == "f" for e in after), after)
        self.assertEqual(sorted(allocs[e[1]] for e in after), sorted([16 * 32 * 4, 32 * 4, 32 * 4 * 4, 4 * 4]))

    def test_activations_double_with_the_batch(self):
        def build():
            return mlp(d_in=64, hidden=1000, d_out=4)

        def batch(n):
            return mlp_batch(n, d_in=64)

        peaks = []
        for n in (1, 2):
            rec, allocs, _ = self.record(build, batch, mlp_step, batch_size=n, steps=1)
            peaks.append(rec)
        s1 = [e[2] for e in peaks[0].events if e[0] == "a"]
        s2 = [e[2] for e in peaks[1].events if e[0] == "a"]
        self.assertEqual(len(s1), len(s2))
        hidden = 1000 * 4
        self.assertIn(hidden, s1)
        self.assertIn(2 * hidden, s2)
        changed = [(a, b) for a, b in zip(s1, s2) if a != b]
        self.assertTrue(changed)
        for a, b in changed:  # every size that depends on the batch doubles
            self.assertEqual(b, 2 * a, (a, b))

    def test_model_built_before_the_recording(self):
        torch.manual_seed(0)
        built = mlp()
        rec, allocs, _ = self.record(lambda: built, mlp_batch, mlp_step, batch_size=2, steps=1)
        self.assertEqual([allocs[i] for i in range(4)], [2048, 128, 512, 16])
        self.assertEqual(built[0].weight.device.type, "cpu")  # the caller's model is not moved
        self.assertFalse(isinstance(built[0].weight, torch._subclasses.fake_tensor.FakeTensor))

    def test_constructor_reading_values(self):
        class Gated(torch.nn.Module):
            def __init__(self):
                super().__init__()
                big = torch.ones(300, 300)  # fake: past LAZY_NUMEL
                self.scale = float(big.sum().item())  # a value the constructor needs
                self.lin = torch.nn.Linear(16, 4)

            def forward(self, x):
                return self.lin(x) / self.scale

        rec, allocs, _ = self.record(Gated, mlp_batch, mlp_step, batch_size=2, steps=1)
        self.assertTrue(any("built for real on the CPU" in n for n in rec.notes), rec.notes)
        self.assertEqual([allocs[0], allocs[1]], [16 * 4 * 4, 4 * 4])

    def test_module_called_twice(self):
        class Twice(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(16, 16)
                self.out = torch.nn.Linear(16, 4)

            def forward(self, x):
                return self.out(torch.relu(self.lin(torch.relu(self.lin(x)))))

        once, _, _ = self.record(mlp, mlp_batch, mlp_step, batch_size=4, steps=1)
        rec, allocs, _ = self.record(Twice, mlp_batch, mlp_step, batch_size=4, steps=1)
        # the shared weight has one gradient, accumulated: one 16x16 fp32
        # allocation for it in the backward besides the parameter
        params = {0, 1}
        w_sized = [i for i, s in allocs.items() if s == 16 * 16 * 4 and i not in params]
        self.assertGreaterEqual(len(w_sized), 3)  # gradient, two moments (and the accumulation)
        live_w = [i for i, s, freed in rec.allocations() if s == 16 * 16 * 4 and not freed]
        self.assertEqual(len(live_w), 3)  # weight, exp_avg, exp_avg_sq

    def test_item_in_forward_is_a_placeholder_with_a_note(self):
        def step(model, batch):
            x, y = batch
            out = model(x)
            noise = torch.randn_like(out)  # drawn on the device: its values are not known
            if (out + noise).abs().max().item() > 1e9:  # data-dependent: not seen
                out = out * 0
            return torch.nn.functional.cross_entropy(out, y)

        rec, _, _ = self.record(mlp, mlp_batch, step, batch_size=2, steps=1)
        self.assertTrue(any("placeholder" in n and "test_predict_recorder.py" in n for n in rec.notes), rec.notes)

    def test_boolean_mask_is_an_upper_bound_with_a_note(self):
        def step(model, batch):
            x, y = batch
            out = model(x) + torch.randn(2, 4, device="cuda")  # drawn on the device: not known
            positive = out[out > 0]  # as many elements as the mask has true ones
            return torch.nn.functional.cross_entropy(out, y) + positive.sum() * 0

        rec, allocs, _ = self.record(mlp, mlp_batch, step, batch_size=2, steps=1)
        self.assertTrue(any("boolean mask" in n and "upper bound" in n for n in rec.notes), rec.notes)
        self.assertIn(2 * 4 * 4, allocs.values())  # every one of the 2x4 outputs, fp32

    def test_boolean_mask_of_known_values_is_exact(self):
        from gpumem.predict import recording

        with recording(None, "h200") as rec:
            ids = torch.tensor([[3, 0, 5, 0, 7, 0, 0, 9]] * 64).to("cuda")  # from the host: known
            kept = ids[ids > 0]
            where = torch.nonzero(ids)
        self.assertEqual(tuple(kept.shape), (4 * 64,))
        self.assertEqual(tuple(where.shape), (4 * 64, 2))
        self.assertFalse(any("upper bound" in n for n in rec.notes), rec.notes)
        sizes = [e[2] for e in rec.events if e[0] == "a"]
        self.assertIn(4 * 64 * 2 * 8, sizes)  # nonzero's output, recorded

    def test_written_trace_file(self):
        rec = self.record_step(mlp, mlp_batch, mlp_step, batch_size=2, steps=2)
        with tempfile.TemporaryDirectory() as d:
            path = rec.write(os.path.join(d, "t.trace"))
            with open(path) as f:
                text = f.read()
        self.assertTrue(text.startswith("# gpumem-trace v1\n"))
        self.assertIn("# batch_size 2\n", text)
        self.assertIn("# note: device profile h200-torch2.11", text)
        parse(text.splitlines())

    @unittest.skipUnless(torch is not None and hasattr(torch, "accelerator"), "needs torch.accelerator")
    def test_accelerator_is_the_fake_gpu(self):
        # Accelerate (the HF Trainer's device placement) asks torch.accelerator, not torch.cuda,
        # where batches go: on a CPU machine it said "none", and each batch stayed on the CPU
        # beside a model on the fake GPU
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="accelerator"):
            self.assertEqual(torch.accelerator.current_accelerator(), torch.device("cuda"))
            self.assertTrue(torch.accelerator.is_available())
            self.assertEqual(torch.accelerator.device_count(), 1)

    def test_memory_fraction_is_kept(self):
        # a script's own cap: the command answers for it (CommandTest), so it is kept, and
        # refused as PyTorch refuses it
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="fraction") as rec:
            self.assertEqual(torch.cuda.get_per_process_memory_fraction(), 1.0)
            torch.cuda.set_per_process_memory_fraction(0.5)
            self.assertEqual(torch.cuda.get_per_process_memory_fraction(), 0.5)
            with self.assertRaises(ValueError):
                torch.cuda.set_per_process_memory_fraction(1.5)
            with self.assertRaises(TypeError):
                torch.cuda.set_per_process_memory_fraction(1)
        self.assertEqual(rec.memory_fraction, 0.5)

    def test_data_loader_workers_and_pinning(self):
        # a loader's workers would get the fake tensors a large dataset is made of (a spawned one
        # cannot unpickle them) and its pinning thread pins for real, which needs a GPU: batches
        # are loaded in this process, unpinned (host memory is not what is predicted)
        from gpumem.predict.recorder import recording

        data = torch.utils.data.TensorDataset(torch.randn(70000, 2))  # fake: past 65,536 elements
        with recording(None, None, workload="loader") as rec:
            loader = torch.utils.data.DataLoader(data, batch_size=35000, pin_memory=True, num_workers=2,
                                                 persistent_workers=True, multiprocessing_context="spawn")
            batches = [x.cuda() for (x,) in loader]
            self.assertEqual(torch.randn(4).pin_memory().shape, (4,))
        self.assertEqual([tuple(b.shape) for b in batches], [(35000, 2), (35000, 2)])
        self.assertTrue(any("worker processes were not started" in n for n in rec.notes), rec.notes)
        self.assertNotIn("pin_memory", torch.Tensor.__dict__)  # PyTorch's own again
        self.assertEqual(torch.utils.data.DataLoader(data, num_workers=2).num_workers, 2)

    def test_data_loader_shorter_than_the_batch(self):
        # a dataset shorter than the batch: with drop_last no batch at all (a loop counting its
        # steps would never end), so the recording stops naming both; without, the batches are
        # as short as on the GPU, and a note says so
        from gpumem.predict.recorder import RecorderError, recording

        data = torch.utils.data.TensorDataset(torch.randn(300, 2))
        with self.assertRaisesRegex(RecorderError, "has 300 items, fewer than its batch size 512, and drop_last"):
            with recording(None, None, workload="short"):
                torch.utils.data.DataLoader(data, batch_size=512, drop_last=True)
        with recording(None, None, workload="short") as rec:
            batches = [x.cuda() for (x,) in torch.utils.data.DataLoader(data, batch_size=512)]
            torch.utils.data.DataLoader(data, batch_size=300, drop_last=True)  # one whole batch: no note
        self.assertEqual([tuple(b.shape) for b in batches], [(300, 2)])
        self.assertEqual([n for n in rec.notes if "items, fewer than the batch size" in n],
                         ["a DataLoader's dataset has 300 items, fewer than the batch size 512: its batches were that "
                          "short, as they would be on the GPU (a training set that short makes the memory at any "
                          "larger batch that of 300)"])

    def test_data_parallel_over_the_one_gpu(self):
        # old scripts wrap the model in nn.DataParallel even on one GPU: it scatters each input
        # through a CUDA-only function, which on one device is the input itself
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="dp") as rec:
            model = torch.nn.DataParallel(mlp()).cuda()
            out = model(torch.randn(8, 16).cuda())
            self.assertEqual((out.device.type, tuple(out.shape)), ("cuda", (8, 4)))
        self.assertGreater(rec.peak_live_bytes, 8 * 4 * 4)

    def test_inference_mode_records_as_no_grad(self):
        # torch.tensor(data, device="cuda") under inference_mode copies below the fake tensors
        # (a real CUDA tensor: on a machine with no GPU, an error); it is recorded as no_grad,
        # which asks for the same memory, as a context manager and as a decorator
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="inference") as rec:
            with torch.inference_mode():
                token = torch.tensor(5, device="cuda", dtype=torch.long)
                self.assertFalse(torch.is_grad_enabled())

            @torch.inference_mode()
            def grads_on():
                return torch.is_grad_enabled()

            self.assertFalse(grads_on())
            self.assertTrue(torch.is_grad_enabled())
        self.assertEqual(token.device.type, "cuda")
        self.assertTrue(rec.peak_live_bytes >= 8)
        self.assertIs(torch.inference_mode, torch.autograd.grad_mode.inference_mode)  # PyTorch's own again

    def test_timing_and_device_readings(self):
        # what scripts print about their steps: CUDA events' times, NVML's readings, and the
        # device they switch to for a block
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="readings"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.cuda.device(0):
                x = torch.zeros(4, device="cuda")
            end.record()
            torch.cuda.synchronize()
            line = "%.2f ms, %d%% busy, %d bytes" % (start.elapsed_time(end), torch.cuda.utilization(),
                                                     torch.cuda.device_memory_used())  # fmt: skip
        self.assertEqual(line, "0.00 ms, 0% busy, 16 bytes")
        self.assertEqual(x.device.type, "cuda")

    def test_profiling_and_memory_history_calls(self):
        # what a script that studies itself calls: PyTorch's memory history and snapshot, NVTX
        # ranges, the profiler (off: on fake tensors it took minutes for a few steps)
        from gpumem.predict.recorder import recording

        with tempfile.TemporaryDirectory() as d, recording(None, None, workload="studied") as rec:
            torch.cuda.memory._record_memory_history(max_entries=1000)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                torch.cuda.nvtx.range_push("step")
                x = torch.zeros(1024, device="cuda")
                torch.cuda.nvtx.range_pop()
            self.assertEqual(prof.key_averages().table(sort_by="cuda_time_total"), "")
            torch.cuda.memory._dump_snapshot(os.path.join(d, "snap.pickle"))
            self.assertEqual(os.listdir(d), [])
        self.assertEqual(x.device.type, "cuda")
        self.assertTrue(any("profiler" in n for n in rec.notes), rec.notes)
        self.assertTrue(any("_dump_snapshot" in n for n in rec.notes), rec.notes)
        self.assertIsNot(torch.profiler.profile, type(prof))

    def test_memory_statistics_in_pytorchs_keys(self):
        # a script that prints its own memory: memory_stats() in PyTorch's keys and pools, the
        # summary PyTorch formats from them, a peak that resets
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="stats"):
            small = torch.zeros(100, device="cuda")  # 400 bytes: the small pool, as 512
            large = torch.zeros(1 << 20, device="cuda")  # 4 MiB: the large pool
            stats = torch.cuda.memory_stats()
            self.assertEqual(stats["allocated_bytes.all.current"], 512 + (4 << 20))
            self.assertEqual(stats["allocated_bytes.small_pool.current"], 512)
            self.assertEqual(stats["requested_bytes.small_pool.current"], 400)
            self.assertEqual(stats["allocation.large_pool.current"], 1)
            self.assertEqual(torch.cuda.memory_allocated(), 512 + (4 << 20))
            self.assertEqual(torch.cuda.memory.memory_allocated(), 512 + (4 << 20))
            del large
            self.assertEqual(torch.cuda.max_memory_allocated(), 512 + (4 << 20))
            torch.cuda.reset_peak_memory_stats()
            self.assertEqual(torch.cuda.max_memory_allocated(), 512)
            self.assertEqual(torch.cuda.memory_stats()["allocation.all.freed"], 1)
            torch.cuda.reset_accumulated_memory_stats()
            self.assertEqual(torch.cuda.memory_stats()["allocation.all.freed"], 0)
            summary = torch.cuda.memory_summary()
            self.assertIn("PyTorch CUDA memory summary", summary)
            self.assertIn("from small pool", summary)
            if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_stats"):
                self.assertEqual(torch.accelerator.memory_stats()["allocated_bytes.all.current"], 512)
        self.assertEqual(small.device.type, "cuda")

    def test_fft_workspaces_are_noted(self):
        # cuFFT takes a workspace within each transform, which fake tensors do not make
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="fft") as rec:
            x = torch.randn(4, 256, device="cuda")
            self.assertFalse(any("cuFFT" in n for n in rec.notes))
            torch.fft.irfft(torch.fft.rfft(x), n=256)
        self.assertTrue(any("cuFFT's plan workspaces" in n for n in rec.notes), rec.notes)

    def test_complex_to_real_transform_copies_its_input(self):
        # cuFFT's c2r overwrites its input: PyTorch transforms a copy, made after the output
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="irfft") as rec:
            spectrum = torch.randn(4, 129, dtype=torch.complex64, device="cuda")
            before = len(rec.allocations())
            signal = torch.fft.irfft(spectrum, n=256)
            made = rec.allocations()[before:]
        self.assertEqual(signal.shape, (4, 256))
        self.assertEqual([(size, freed) for _, size, freed in made], [(4 * 256 * 4, False), (4 * 129 * 8, True)])

    def test_softmax_of_a_transposed_input_copies_it(self):
        # CUDA's softmax kernels read a contiguous input: a log_softmax of logits.t() makes its
        # output, then a copy of its input given back within the call (an H100 made it for a
        # bf16 32768 x 32768 matrix); a contiguous input makes the output alone
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="softmax") as rec:
            logits = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
            before = len(rec.allocations())
            out = torch.log_softmax(logits.t(), dim=1)
            transposed = rec.allocations()[before:]
            before = len(rec.allocations())
            out2 = torch.softmax(logits, dim=1)
            contiguous = rec.allocations()[before:]
        self.assertEqual([(size, freed) for _, size, freed in transposed], [(64 * 32 * 2, False), (64 * 32 * 2, True)])
        self.assertEqual([(size, freed) for _, size, freed in contiguous], [(64 * 32 * 2, False)])
        self.assertEqual((out.shape, out2.shape), ((32, 64), (64, 32)))

    def test_recurrent_layers_are_noted(self):
        # without cuDNN an LSTM runs a fused cell a time step, which is not what the GPU runs
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="lstm") as rec:
            lstm = torch.nn.LSTM(8, 16).cuda()
            lstm(torch.randn(5, 2, 8, device="cuda"))[0].sum().backward()
        self.assertTrue(any("an LSTM or GRU ran cell by cell" in n for n in rec.notes), rec.notes)

    def test_random_state_of_the_one_fake_gpu(self):
        # Lightning saves and restores every device's random state around a fit: one state,
        # for the one device, where PyTorch's own (CUDA never initialised) has none to read
        from gpumem.predict.recorder import recording

        with recording(None, None, workload="rng"):
            states = torch.cuda.get_rng_state_all()
            self.assertEqual(len(states), torch.cuda.device_count())
            self.assertEqual(states[0].dtype, torch.uint8)
            torch.cuda.set_rng_state_all(states)
            torch.cuda.set_rng_state(torch.cuda.get_rng_state())

    def test_cuda_state_is_put_back(self):
        available, count = torch.cuda.is_available(), torch.cuda.device_count()
        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        self.record_step(mlp, mlp_batch, mlp_step, batch_size=1, steps=1)
        self.assertEqual(torch.cuda.is_available(), available)  # as before: False here, True on a GPU machine
        self.assertEqual(torch.cuda.device_count(), count)
        if hasattr(torch, "accelerator"):
            self.assertEqual(torch.accelerator.current_accelerator(), accelerator)
        from torch.optim import optimizer

        self.assertNotIn(torch._subclasses.fake_tensor.FakeTensor, optimizer._foreach_supported_types)
        m = mlp()
        m.to(torch.float64)  # nn.Module._apply is PyTorch's again
        self.assertEqual(m[0].weight.dtype, torch.float64)


@unittest.skipIf(torch is None, NO_TORCH)
@unittest.skipIf(transformers is None, "needs transformers (pip install transformers)")
class TransformersTest(unittest.TestCase):
    def setUp(self):
        transformers.logging.set_verbosity_error()

    def _run(self, build, vocab, n, autocast=True):
        from gpumem.predict import record_step

        def batch(b):
            ids = torch.randint(0, vocab, (b, 32))
            return {"input_ids": ids, "labels": ids}

        def step(model, b):
            if autocast:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return model(**b).loss
            return model(**b).loss

        rec = record_step(build, batch, step, batch_size=n, steps=2)
        parse(rec.lines())
        return rec

    def test_gpt2(self):
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)

        def build():
            return transformers.GPT2LMHeadModel(cfg)

        recs = [self._run(build, 1000, n) for n in (1, 2)]
        n_params = sum(p.numel() for p in build().parameters())
        for rec in recs:
            params = sum(s for _, s, freed in rec.allocations() if not freed and s not in (WORKSPACE, LT_WORKSPACE))
            self.assertEqual(params, 3 * 4 * n_params)  # weights, exp_avg, exp_avg_sq (fp32)
        # bf16 logits (batch x 32 x vocab) under autocast, twice as many at batch 2
        s1 = {s for _, s, _ in recs[0].allocations()}
        s2 = {s for _, s, _ in recs[1].allocations()}
        self.assertIn(32 * 1000 * 2, s1)
        self.assertIn(2 * 32 * 1000 * 2, s2)
        # autocast's cached bf16 copy of the tied 1000x64 embedding
        self.assertIn(1000 * 64 * 2, s1)
        self.assertGreater(recs[1].peak_live_bytes, recs[0].peak_live_bytes)

    def test_llama(self):
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=500, max_position_embeddings=64,
        )  # fmt: skip

        def build():
            return transformers.LlamaForCausalLM(cfg)

        rec = self._run(build, 500, 2)
        model = build()
        n_params = sum(p.numel() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # rotary inv_freq
        live = sum(s for _, s, freed in rec.allocations() if not freed and s not in (WORKSPACE, LT_WORKSPACE))
        self.assertEqual(live, 3 * 4 * n_params + buffers)

    def test_mixture_of_experts_under_autocast(self):
        # transformers casts the tokens to its float32 experts' type for
        # torch._grouped_mm, which CUDA runs and the meta function refuses
        if not hasattr(transformers, "MixtralConfig"):
            self.skipTest("needs transformers with Mixtral")
        cfg = transformers.MixtralConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=500, max_position_embeddings=64, num_local_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip

        def build():
            return transformers.MixtralForCausalLM(cfg)

        rec = self._run(build, 500, 2)
        n_params = sum(p.numel() for p in build().parameters())
        live = sum(s for _, s, freed in rec.allocations() if not freed and s not in (WORKSPACE, LT_WORKSPACE))
        self.assertGreaterEqual(live, 3 * 4 * n_params)

    def test_checkpointing_under_autocast(self):
        # the recomputation in the backward runs under autocast too: its
        # tensors must come out bf16 as in the forward (else checkpoint
        # refuses the step: "Recomputed values ... different metadata")
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)

        def build():
            m = transformers.GPT2LMHeadModel(cfg)
            m.gradient_checkpointing_enable()
            return m

        plain = self._run(lambda: transformers.GPT2LMHeadModel(cfg), 1000, 2)
        ckpt = self._run(build, 1000, 2)

        def lt(rec):
            return sum(1 for _, s, _ in rec.allocations() if s == LT_WORKSPACE)

        # the recomputation's biased matmuls run on autograd's thread, which takes a
        # cuBLASLt workspace of its own (as on the GPU); past that, checkpointing saves
        self.assertEqual((lt(plain), lt(ckpt)), (1, 2))
        self.assertLess(ckpt.peak_live_bytes - LT_WORKSPACE, plain.peak_live_bytes)

    def test_generate_runs_to_its_length(self):
        from gpumem.predict import recording

        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                      pad_token_id=0)  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
        import transformers.generation.utils as gen

        loop_check = gen.GenerationMixin._has_unfinished_sequences
        sizes = {}
        for new in (2, 6):
            with recording(None, "h200") as rec:
                m = model.to("cuda")
                ids = torch.randint(1, 100, (2, 8), device="cuda")
                out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)  # fmt: skip
                self.assertEqual(tuple(out.shape), (2, 8 + new))
            sizes[new] = len(rec.allocations())
            self.assertTrue(any("generate() ran every sequence" in n for n in rec.notes), rec.notes)
        self.assertGreater(sizes[6], sizes[2])  # more tokens, more steps of the loop
        # the loop is put back as it was
        self.assertIs(gen.GenerationMixin._has_unfinished_sequences, loop_check)
        # a training step reads placeholders too (the loss), with the generation module loaded:
        # the note is for jobs that generate, not for every job that imports transformers
        with recording(None, "h200") as rec:
            m = model.to("cuda")
            ids = torch.randint(1, 100, (2, 8), device="cuda")
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            float(loss.item())
        self.assertTrue(any("placeholder" in n for n in rec.notes), rec.notes)
        self.assertFalse(any("generate()" in n for n in rec.notes), rec.notes)


@unittest.skipIf(torch is None, NO_TORCH)
class AttentionTest(unittest.TestCase):
    """scaled_dot_product_attention on fake CUDA tensors runs the kernel the
    profile's GPU would: a fused one keeps no batch x heads x L x L scores,
    the math backend does; a checkpoint's recomputation (autograd's engine
    runs it with no function modes) takes the same kernel."""

    B, H, L, D = 2, 4, 128, 64

    def attention_step(self, dtype, mask=None, checkpoint=False, heads_kv=None):
        from gpumem.predict import recording

        B, H, L, D = self.B, self.H, self.L, self.D
        with recording(None, "h200") as rec:
            q = torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True)
            kv = torch.randn(B, heads_kv or H, L, D, device="cuda", dtype=dtype, requires_grad=True)

            def attend(q, kv):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, kv, kv, attn_mask=mask, is_causal=mask is None, enable_gqa=heads_kv is not None
                )

            if checkpoint:
                import torch.utils.checkpoint as cp

                out = cp.checkpoint(attend, q, kv, use_reentrant=False)
            else:
                out = attend(q, kv)
            out.sum().backward()
        return rec

    def scores(self, rec, itemsize):
        """Allocations the size of the attention scores (B x H x L x L)."""
        n = self.B * self.H * self.L * self.L * itemsize
        return sum(1 for _, s, _ in rec.allocations() if s == n)

    def test_fused_kernel_keeps_no_scores(self):
        for ckpt in (False, True):
            rec = self.attention_step(torch.bfloat16, checkpoint=ckpt)
            self.assertEqual(self.scores(rec, 2) + self.scores(rec, 4), 0, ckpt)
            self.assertFalse(any("math backend" in n for n in rec.notes), rec.notes)

    def test_grouped_query_attention_is_fused(self):
        rec = self.attention_step(torch.bfloat16, heads_kv=2)
        self.assertEqual(self.scores(rec, 2) + self.scores(rec, 4), 0)

    def test_cudnn_workspaces_in_order(self):
        """cuDNN's attention as PyTorch's allocation history shows it on an
        H200: the forward's outputs, then its 256-byte workspace, freed at
        once; the backward's three gradients, then 4.0625 bytes per
        element of q, freed at once."""
        from gpumem.predict import recording

        with recording(None, "h200") as rec:
            q, k, v = (torch.randn(self.B, self.H, self.L, self.D, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip
            before = len(rec.events)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            forward = len(rec.events)
            o.backward(torch.ones_like(o))
        numel = self.B * self.H * self.L * self.D
        ev = rec.events[before:forward]
        sizes = [e[2] for e in ev if e[0] == "a"]
        # the RNG seed and offset, the output, the softmax statistics (fp32), the workspace
        self.assertEqual(sizes, [8, 8, 2 * numel, 4 * self.B * self.H * self.L, 256])
        self.assertEqual(ev[-1], ("f", ev[-2][1]))
        ev = rec.events[forward:]
        # (the gradient of o, then dq, dk, dv)
        grads = [k for k, e in enumerate(ev) if e[0] == "a" and e[2] == 2 * numel]
        self.assertEqual(len(grads), 4)
        after = ev[grads[-1] + 1]
        self.assertEqual(after[:3:2], ("a", int(4.0625 * numel)))
        self.assertEqual(ev[grads[-1] + 2], ("f", after[1]))

    def test_learned_bias_runs_math(self):
        # a mask that requires grad (T5's position bias) takes no fused kernel
        bias = torch.zeros(1, self.H, self.L, self.L, device="cpu", requires_grad=True)
        from gpumem.predict import recording

        with recording(None, "h200") as rec:
            b = bias.to("cuda").to(torch.bfloat16)
            q = torch.randn(self.B, self.H, self.L, self.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=b).sum().backward()
        self.assertGreater(self.scores(rec, 2), 0)
        self.assertTrue(any("math backend" in n for n in rec.notes), rec.notes)

    def test_autocast_casts_right_to_left(self):
        # a Llama's q and k leave its rotary embedding in fp32: autocast casts
        # the call's arguments right to left, k before q, as on the GPU
        from gpumem.predict import recording

        B, L, D = self.B, self.L, self.D
        with recording(None, "h200") as rec:
            q = torch.randn(B, 8, L, D, device="cuda")
            k = torch.randn(B, 2, L, D, device="cuda")
            v = torch.randn(B, 2, L, D, device="cuda", dtype=torch.bfloat16)
            before = len(rec.events)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        sizes = [e[2] for e in rec.events[before:] if e[0] == "a"]
        self.assertEqual(sizes[:2], [B * 2 * L * D * 2, B * 8 * L * D * 2])  # k in bf16, then q

    def test_function_is_put_back(self):
        before = torch.nn.functional.scaled_dot_product_attention
        self.attention_step(torch.bfloat16)
        self.assertIs(torch.nn.functional.scaled_dot_product_attention, before)


@unittest.skipIf(torch is None, NO_TORCH)
class ConvolutionTest(unittest.TestCase):
    """Convolutions lay out their outputs as cuDNN does on the GPU: a
    channels-last input or weight gives channels-last outputs and a
    weight gradient with the weight's strides, which AccumulateGrad then
    keeps rather than copying."""

    def step(self, layout):
        from gpumem.predict import recording

        with recording(None, "h200") as rec:
            conv = torch.nn.Conv2d(64, 128, 3, padding=1, bias=False).cuda().to(memory_format=layout)
            x = torch.randn(2, 64, 14, 14, device="cuda").to(memory_format=layout)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = conv(x)
            out_layout = y.is_contiguous(memory_format=torch.channels_last)
            before = len(rec.events)
            y.float().sum().backward()
            same_strides = conv.weight.grad.stride() == conv.weight.stride()
        weight_fp32 = 128 * 64 * 9 * 4
        backward = [e for e in rec.events[before:] if e[0] == "a" and e[2] == weight_fp32]
        return rec, out_layout, same_strides, len(backward)

    def test_channels_last_stays_channels_last(self):
        rec, channels_last, same_strides, weight_sized = self.step(torch.channels_last)
        self.assertTrue(channels_last)
        self.assertTrue(same_strides)
        # the backward makes the weight's fp32 gradient once: no copy of it
        self.assertEqual(weight_sized, 1)

    def test_contiguous_stays_contiguous(self):
        rec, channels_last, same_strides, weight_sized = self.step(torch.contiguous_format)
        self.assertFalse(channels_last)
        self.assertTrue(same_strides)
        self.assertEqual(weight_sized, 1)


class ConvSequenceTest(unittest.TestCase):
    """probe.sequence_of: a watched convolution's allocation history as the
    steps the recorder puts in its trace (no torch needed)."""

    def test_outputs_and_workspaces_in_order(self):
        from gpumem.predict.probe import sequence_of

        entries = [
            {"action": "alloc", "addr": 10, "size": 4096},  # grad_input
            {"action": "alloc", "addr": 20, "size": 1 << 20},  # its workspace
            {"action": "free_requested", "addr": 20, "size": 1 << 20},
            {"action": "free_completed", "addr": 20, "size": 1 << 20},
            {"action": "alloc", "addr": 20, "size": 512},  # grad_weight, where the workspace was
            {"action": "alloc", "addr": 30, "size": 2 << 20},  # a second workspace
            {"action": "free_requested", "addr": 30, "size": 2 << 20},
            {"action": "free_requested", "addr": 5, "size": 64},  # allocated before the call: not the call's
        ]
        self.assertEqual(sequence_of(entries, {10: 0, 20: 1}),
                         [("out", 0), ("a", 1, 1 << 20), ("f", 1), ("out", 1), ("a", 3, 2 << 20), ("f", 3)])

    def test_a_kept_allocation_that_is_no_output(self):
        from gpumem.predict.probe import sequence_of

        entries = [{"action": "alloc", "addr": 10, "size": 4096}, {"action": "alloc", "addr": 11, "size": 512}]
        self.assertIsNone(sequence_of(entries, {10: 0}))


@unittest.skipIf(torch is None, NO_TORCH)
class ConvProbeTest(unittest.TestCase):
    """The recorder with a convolution probe: what the probe says a call
    allocated goes into the trace in its order, the first call's sequence
    at a problem's first occurrence and the later calls' after; the
    modelled bias-gradient staging and the workspace note give way to it;
    a probe that fails leaves the outputs alone, with a note. The probe's
    GPU side is replaced by a stub here (ConvProbeOnGpuTest runs it)."""

    FIRST, LATER = 3 << 20, 1 << 20  # a forward's workspaces, first call and later ones

    def stub(self, calls):
        from gpumem.predict.probe import ConvProbe

        def run(func, args, kwargs, fake_out):
            calls.append(str(func))
            if "backward" in str(func):
                # grad_input, its workspace, grad_weight, its workspace, grad_bias
                seq = [("out", 0), ("a", 1, 5 << 20), ("f", 1), ("out", 1), ("a", 3, 7 << 20), ("f", 3), ("out", 2)]
                return seq, seq
            return [("out", 0), ("a", 1, self.FIRST), ("f", 1)], [("out", 0), ("a", 1, self.LATER), ("f", 1)]

        return ConvProbe(torch, run=run)

    def record(self, probe, steps=2):
        from gpumem.predict import recording

        with recording(None, "h200", probe=probe) as rec:
            conv = torch.nn.Conv2d(8, 16, 3, padding=1).cuda()
            for _ in range(steps):
                x = torch.randn(4, 8, 32, 32, device="cuda", requires_grad=True)
                conv(x).sum().backward()
                conv.weight.grad = conv.bias.grad = None
        return rec

    def test_probed_sequence_in_the_trace(self):
        calls = []
        rec = self.record(self.stub(calls))
        sizes = [e[2] for e in rec.events if e[0] == "a"]
        out_bytes = 4 * 16 * 32 * 32 * 4
        # the forward: its output, then the workspace: the first call's, then the later one's
        first = sizes.index(self.FIRST)
        self.assertEqual(sizes[first - 1], out_bytes)
        self.assertEqual(sizes.count(self.FIRST), 1)
        self.assertEqual(sizes.count(self.LATER), 1)
        self.assertGreater(sizes.index(self.LATER), first)
        # the backward: grad_input, 5 MiB, grad_weight, 7 MiB, grad_bias; no modelled staging beside them
        i = sizes.index(5 << 20)
        self.assertEqual(sizes[i - 1:i + 4], [4 * 8 * 32 * 32 * 4, 5 << 20, 16 * 8 * 9 * 4, 7 << 20, 16 * 4])
        # each workspace is given back at once, before the next allocation
        events = rec.events
        for k, e in enumerate(events):
            if e[0] == "a" and e[2] in (self.FIRST, self.LATER, 5 << 20, 7 << 20):
                self.assertEqual(events[k + 1], ("f", e[1]))
        # one probe per problem: the forward and the backward
        self.assertEqual(len(calls), 2)
        self.assertFalse(any("cuDNN convolution workspaces" in n for n in rec.notes), rec.notes)

    def test_autotuner_on_is_noted(self):
        # cuDNN's benchmark mode sizes its trials' workspaces by the memory free at the time, which
        # no recording reproduces: a note says so, probed or not
        before = torch.backends.cudnn.benchmark
        try:
            torch.backends.cudnn.benchmark = True
            for probe in (self.stub([]), None):
                rec = self.record(probe, steps=1)
                self.assertEqual(sum("cuDNN's autotuner was on" in n for n in rec.notes), 1, rec.notes)
            torch.backends.cudnn.benchmark = False
            rec = self.record(None, steps=1)
            self.assertFalse(any("autotuner" in n for n in rec.notes), rec.notes)
        finally:
            torch.backends.cudnn.benchmark = before

    def test_a_failing_probe_leaves_the_outputs(self):
        from gpumem.predict.probe import ConvProbe

        calls = []

        def run(func, args, kwargs, fake_out):
            calls.append(func)
            raise RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB")

        rec = self.record(ConvProbe(torch, run=run), steps=2)
        plain = self.record(None, steps=2)
        self.assertEqual([e for e in rec.events if e[0] == "a"], [e for e in plain.events if e[0] == "a"])
        self.assertEqual(len(calls), 2)  # the forward and the backward, each tried once
        self.assertTrue(any("could not be run on the GPU (RuntimeError: CUDA out of memory" in n for n in rec.notes),
                        rec.notes)

    def test_no_gpu_is_named(self):
        from gpumem.predict.probe import ConvProbe, ProbeError

        if torch.cuda.is_available():
            self.skipTest("a GPU is visible")
        with self.assertRaisesRegex(ProbeError, "no GPU"):
            ConvProbe(torch)


@unittest.skipIf(torch is None or not torch.cuda.is_available(), "needs a GPU")
class ConvProbeOnGpuTest(unittest.TestCase):
    """On the GPU: a small convolutional network's training steps (bf16
    autocast, channels-last, a depthwise convolution and biases) recorded
    on fake tensors with the probe equal, allocation by allocation, what
    PyTorch's allocator saw when the same steps ran for real."""

    def test_matches_the_gpu(self):
        code = textwrap.dedent("""
            import json, sys
            import torch
            sys.path.insert(0, %r)
            from gpumem.predict import _child, probe, recording

            def net():
                torch.manual_seed(0)
                return torch.nn.Sequential(
                    torch.nn.Conv2d(3, 64, 7, stride=2, padding=3), torch.nn.ReLU(),
                    torch.nn.Conv2d(64, 64, 7, padding=3, groups=64), torch.nn.Conv2d(64, 128, 1),
                    torch.nn.Conv2d(128, 128, 3, stride=2, padding=1, bias=False), torch.nn.AdaptiveAvgPool2d(1),
                    torch.nn.Flatten(), torch.nn.Linear(128, 10))

            def steps(batch):
                model = net().cuda().to(memory_format=torch.channels_last)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(3):
                    x = torch.randn(batch, 3, 96, 96, device="cuda").to(memory_format=torch.channels_last)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(x).float().sum()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            batch = int(sys.argv[1])
            if sys.argv[2] == "gpu":
                torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
                steps(batch)
                torch.cuda.synchronize()
                entries = torch.cuda.memory._snapshot()["device_traces"][0]
                rec = _child.history_to_recording(entries, [], "net", "gpu")
            else:
                conv = probe.ConvProbe(torch)
                with recording(None, "h200", probe=conv) as rec:
                    steps(batch)
            print(json.dumps([e[2] for e in rec.events if e[0] == "a"]))
        """ % PYTHON_DIR)
        for batch in (4, 64):
            sizes = {}
            for mode in ("gpu", "probe"):
                done = subprocess.run([sys.executable, "-c", code, str(batch), mode], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, timeout=600)  # fmt: skip
                self.assertEqual(done.returncode, 0, done.stderr.decode()[-2000:])
                sizes[mode] = json.loads(done.stdout.decode().strip().splitlines()[-1])
            gpu, fake = sizes["gpu"], sizes["probe"]
            k = next((i for i, (a, b) in enumerate(zip(gpu, fake)) if a != b), min(len(gpu), len(fake)))
            self.assertEqual(fake, gpu, "batch %d: %d allocations on the GPU, %d recorded; from allocation %d on, "
                             "GPU %s, recorded %s" % (batch, len(gpu), len(fake), k, gpu[k:k + 6], fake[k:k + 6]))


@unittest.skipIf(torch is None, NO_TORCH)
class ModuleMoveTest(unittest.TestCase):
    """A model moved to the GPU allocates its parameters in the order
    PyTorch's Module._apply converts them: each module's children before
    its own parameters (a ViT's class token after its blocks)."""

    def test_children_before_own_parameters(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from gpumem.predict import recording

        class Outer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.token = torch.nn.Parameter(torch.zeros(3))
                self.inner = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 11, bias=False))
                self.register_buffer("table", torch.zeros(13))
                self.last = torch.nn.Linear(11, 2)

        # PyTorch's own order: what a real conversion on the CPU makes, element counts
        made = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
                    made.append(out.numel())
                return out

        model = Outer()
        with Watch():
            model.double()
        with recording(None, "h200") as rec:
            Outer().cuda()
        moved = [e[2] // 4 for e in rec.events if e[0] == "a"]
        self.assertEqual(moved, made)
        self.assertEqual(moved[-2:], [3, 13])  # the outer module's own, last


    def test_tied_weights_as_pytorch_moves_them(self):
        # .cuda() of a CPU model keeps tied weights tied (PyTorch converts in place);
        # to_empty of a meta-built one unties them, each with memory of its own
        # (what real PyTorch does, checked here on the CPU: to_empty(device="cpu"))
        from gpumem.predict import recording

        def tied():
            e, lin = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100, bias=False)
            lin.weight = e.weight
            return torch.nn.Sequential(e, lin)

        with torch.device("meta"):
            real = tied()
        real.to_empty(device="cpu")
        real_count = sum(p.numel() for p in real.parameters())
        self.assertEqual(real_count, 2 * 800)  # PyTorch's own: untied
        for build, expect in ((tied, 800), (None, real_count)):
            with recording(None, "h200") as rec:
                if build is None:
                    with torch.device("meta"):
                        model = tied()
                    model.to_empty(device="cuda")
                else:
                    model = build().cuda()
                self.assertEqual(sum(p.numel() for p in model.parameters()), expect)
            moved = sum(e[2] for e in rec.events if e[0] == "a")
            self.assertEqual(moved, expect * 4)


@unittest.skipIf(torch is None, NO_TORCH)
class LeavesTest(unittest.TestCase):
    def test_leaves_are_pytrees(self):
        # the recorder's own walk of an operator's arguments stands in for
        # tree_flatten: the same leaves, the same objects, in the same order
        import collections

        from torch.utils._pytree import tree_flatten

        from gpumem.predict.values import leaves

        pair = collections.namedtuple("pair", "a b")
        t = torch.zeros(2)
        trees = [
            ((t, [1, 2.5, None, True]), {"b": torch.device("cpu"), "a": [torch.float16, torch.Size([2, 3])]}),
            pair(t, (t, "x")),
            torch.return_types.max((t, t)),
            collections.OrderedDict(z=t, y=[t]),
            [torch.strided, torch.contiguous_format, (), [], {}],
            t,
            7,
        ]
        for tree in trees:
            mine, theirs = leaves(tree), tree_flatten(tree)[0]
            self.assertEqual(len(mine), len(theirs), tree)
            self.assertTrue(all(a is b for a, b in zip(mine, theirs)), tree)


@unittest.skipIf(torch is None, NO_TORCH)
class DataDependentSizesTest(unittest.TestCase):
    def test_nms_keeps_every_box_as_an_upper_bound(self):
        try:
            import torchvision
        except ImportError:
            self.skipTest("needs torchvision")
        from gpumem.predict import recording

        with recording(None, "h200") as rec:
            boxes = torch.rand(300, 4, device="cuda") * 100
            keep = torchvision.ops.nms(boxes, torch.rand(300, device="cuda"), 0.5)
            self.assertEqual(tuple(keep.shape), (300,))
            self.assertEqual(keep.dtype, torch.long)
        self.assertIn(300 * 8, [size for _, size, _ in rec.allocations()])
        self.assertTrue(any(n.startswith("torchvision's nms at") and "upper bound" in n for n in rec.notes),
                        rec.notes)  # fmt: skip


@unittest.skipIf(torch is None, NO_TORCH)
class HostCopiesTest(unittest.TestCase):
    """A fake CUDA tensor copied to the CPU (a pipeline's postprocessing of
    generate()'s output): a real CPU tensor with the followed values where
    known, else zeros and a note; past HOST_COPY_NUMEL a fake one, whose
    .numpy() (refused by PyTorch for tensor subclasses) gives the same."""

    def test_known_values_and_placeholders(self):
        from gpumem.predict import recording
        from gpumem.predict.recorder import HOST_COPY_NUMEL
        from torch._subclasses.fake_tensor import FakeTensor

        with recording(None, "h200") as rec:
            known = (torch.ones(2, 3, device="cuda", dtype=torch.long) * 7).cpu()
            unknown = torch.randn(4, device="cuda").to("cpu")
            large = torch.randn(HOST_COPY_NUMEL + 1, device="cuda").cpu()
            kinds = [isinstance(t, FakeTensor) for t in (known, unknown, large)]
            large_values = large.numpy()
        self.assertEqual(kinds, [False, False, True])
        self.assertEqual(known.tolist(), [[7, 7, 7], [7, 7, 7]])
        self.assertEqual((unknown.dtype, unknown.tolist()), (torch.float32, [0.0] * 4))
        self.assertEqual((large_values.shape, large_values.dtype.name, float(abs(large_values).max())),
                         ((HOST_COPY_NUMEL + 1,), "float32", 0.0))  # fmt: skip
        self.assertEqual(len([n for n in rec.notes if "copied from a fake tensor to the CPU" in n]), 1, rec.notes)
        self.assertEqual(len([n for n in rec.notes if "with .numpy() at" in n]), 1, rec.notes)

    def test_a_copy_that_keeps_its_gradient_stays_fake(self):
        from gpumem.predict import recording
        from torch._subclasses.fake_tensor import FakeTensor

        with recording(None, "h200"):
            w = torch.randn(3, device="cuda", requires_grad=True)
            self.assertIsInstance((w * 2).cpu(), FakeTensor)


@unittest.skipIf(torch is None, NO_TORCH)
class GroupedGemmTest(unittest.TestCase):
    """torch._grouped_mm of float32 and float16 matrices (a mixture of
    experts under autocast): run on CUDA as a loop of cuBLAS GEMMs, refused
    by PyTorch's meta function, recorded as the kernel allocates."""

    def grouped(self, dtype, n):
        from gpumem.predict import recording

        experts, tokens, k = 4, 64, 32
        with recording(None, "h200") as rec:
            a = torch.randn(tokens, k, device="cuda", dtype=dtype)
            b = torch.randn(experts, k, n, device="cuda", dtype=dtype)
            offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)
            out = torch._grouped_mm(a, b, offs=offs)
            self.assertEqual((tuple(out.shape), out.dtype), ((tokens, n), dtype))
        return [size for _, size, _ in rec.allocations()], tokens

    def test_float32_output_then_cublas_workspace(self):
        sizes, tokens = self.grouped(torch.float32, 48)
        self.assertEqual(sizes[-2:], [tokens * 48 * 4, WORKSPACE])

    def test_rows_padded_to_16_bytes(self):
        sizes, tokens = self.grouped(torch.float16, 1001)
        self.assertEqual(sizes[-2:], [(tokens - 1) * 1008 * 2 + 1001 * 2, WORKSPACE])

    def test_bfloat16_left_to_pytorch(self):
        sizes, tokens = self.grouped(torch.bfloat16, 48)
        self.assertEqual(sizes[-1], tokens * 48 * 2)
        self.assertNotIn(WORKSPACE, sizes)


@unittest.skipIf(torch is None, NO_TORCH)
class CompiledCodeTest(unittest.TestCase):
    """torch.compile'd code runs eagerly under the recorder (Dynamo compiles
    nothing under a dispatch mode); the notes say so wherever it ran, and
    only there."""

    def compiled_noted(self, rec):
        return any(n.startswith("torch.compile: the compiled code was recorded as eager") for n in rec.notes)

    def test_every_way_of_compiling_is_noted(self):
        from gpumem.predict import recording

        real_compile = torch.compile
        ahead = torch.compile(torch.nn.Linear(8, 8))  # compiled before the recording

        def f(x):
            return (x.sin() * 2).cos().sum()

        def in_place():
            m = torch.nn.Linear(8, 8).cuda()
            m.compile()
            return m

        cases = {
            "module compiled before": lambda: ahead.cuda(),
            "function compiled inside": lambda: torch.compile(f),
            "decorator with options": lambda: torch.compile(dynamic=False)(f),
            "module compiled in place": in_place,
        }
        for name, make in cases.items():
            with recording(None, "h200") as rec:
                fn = make()
                x = torch.randn(4, 8, device="cuda")
                out = fn(x)
                self.assertEqual(out.device.type, "cuda")
            self.assertTrue(self.compiled_noted(rec), (name, rec.notes))
            if name.startswith("function") or name.startswith("decorator"):
                # eager: x, sin, the product, cos and the sum, each its own allocation
                self.assertEqual(len(rec.allocations()), 5, (name, rec.allocations()))
        with recording(None, "h200") as rec:
            f(torch.randn(4, 8, device="cuda"))
            torch.compile(f)  # compiled, never called
        self.assertFalse(self.compiled_noted(rec), rec.notes)
        self.assertIs(torch.compile, real_compile)


@unittest.skipIf(torch is None, NO_TORCH)
class KnownValuesTest(unittest.TestCase):
    """Values read from fake tensors made of constants, or small ones made
    from known values, are the real ones; a tensor written into is unknown
    again and reads as a placeholder."""

    def test_mask_grown_by_generate(self):
        from gpumem.predict import recording

        with recording(None, "h200") as rec:
            mask = torch.ones(2, 16, dtype=torch.long, device="cuda")
            for _ in range(3):
                mask = torch.cat([mask, mask.new_ones((2, 1))], dim=-1)
            padding = mask.bool()[:, torch.arange(8, device="cuda") + 4]
            self.assertTrue(bool(padding.all()))
            self.assertTrue(bool(padding.sum() == padding.numel()))
            self.assertEqual(int(mask.sum()), 2 * 19)
            self.assertFalse(bool(torch.zeros(3, device="cuda").any()))
            self.assertEqual(float(torch.full((2, 2), 2.5, device="cuda").amax()), 2.5)
            self.assertFalse(any("placeholder" in n for n in rec.notes), rec.notes)
            mask[:, -1] = 0  # written into: no longer known
            self.assertFalse(bool(mask.all()))  # the placeholder, not the value
        self.assertTrue(any("placeholder" in n for n in rec.notes), rec.notes)

    def test_small_tensors_followed_value_by_value(self):
        """transformers' check that a batch holds no packed sequences, on
        position ids made on the device, reads what it reads on a GPU; a
        write of unknown values makes the tensor unknown, views included."""
        from gpumem.predict import recording

        with recording(None, "h200") as rec:
            pos = torch.arange(256, device="cuda").unsqueeze(0).expand(4, -1)
            first = pos[:, :1] - 1
            packed = (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)
            self.assertTrue(bool((packed[:, -1] == 0).all()))
            ids = torch.tensor([[5, 7, 9]]).to("cuda")  # copied from the host
            self.assertEqual(int(ids.sum()), 21)
            self.assertEqual(int(ids[0, 1]), 7)
            self.assertFalse(any("placeholder" in n for n in rec.notes), rec.notes)
            row = ids[0]
            ids.add_(torch.randint_like(ids, 3))  # unknown values written in
            int(row.sum())
        self.assertTrue(any("placeholder" in n for n in rec.notes), rec.notes)

    @unittest.skipIf(transformers is None, "needs transformers")
    def test_transformers_sees_real_tensors_while_recording(self):
        from transformers.utils import import_utils

        from gpumem.predict import recording

        with recording(None, "h200"):
            t = torch.ones(2, device="cuda")
            self.assertFalse(import_utils.is_tracing(t))
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            self.assertTrue(import_utils.is_tracing(mode.from_tensor(torch.ones(2))))


class ProfileTest(unittest.TestCase):
    def test_shipped_profile(self):
        self.assertIn("h200-torch2.11", profiles.available())
        p = profiles.load("h200")
        self.assertEqual(p.value("cublas_workspace_bytes"), 32 << 20)
        self.assertEqual(p.capability, (9, 0))
        for key, entry in p.values.items():
            self.assertIn(entry["source"], profiles.SOURCES, key)
            self.assertTrue(entry.get("why"), key)
        self.assertIn("taken from PyTorch's source, not measured: autocast_weight_cache", p.notes()[0])
        self.assertIn("estimated, not measured: cudnn_conv_workspace", p.notes()[0])
        self.assertNotIn("cudnn_conv_workspace", p.notes(measured_elsewhere=("cudnn_conv_workspace",))[0])

    def test_bad_profiles_named(self):
        with self.assertRaisesRegex(ValueError, "no device profile 'a100'"):
            profiles.load("a100")
        with self.assertRaisesRegex(ValueError, "source 'guess'"):
            profiles.Profile({"values": {"x": {"value": 1, "source": "guess"}}})

    def test_device_profile_script_pure_parts(self):
        from gpumem.predict import measure as device_profile

        base = json.loads(json.dumps(profiles.load("h200").data))
        base["values"]["sdpa_backend"]["source"] = "derived"  # (as a profile not yet measured has it)
        measured = {"cublas_workspace_bytes": 33554432, "cuda_context_bytes": 600 << 20}
        out = device_profile.merge(base, measured, gpu="NVIDIA H200", capability=(9, 0), total=141 << 30,
                                   torch_version="2.11.0+cu130", where="an NVIDIA H200 (PyTorch 2.11), 2026-12-06")  # fmt: skip
        ctx = out["values"]["cuda_context_bytes"]
        self.assertEqual((ctx["value"], ctx["source"]), (600 << 20, "measured"))
        # the why is this measurement's, not the base's account of another one
        self.assertEqual(ctx["why"], "measured by python -m gpumem.predict.measure on an NVIDIA H200 (PyTorch 2.11), "
                                     "2026-12-06: " + device_profile.MEANINGS["cuda_context_bytes"])  # fmt: skip
        self.assertNotIn("device_profile.py", out["values"]["cublas_workspace_bytes"]["why"])
        kept = out["values"]["sdpa_cudnn_forward_scratch_bytes"]  # not measured by this command: the base's
        self.assertEqual(kept, base["values"]["sdpa_cudnn_forward_scratch_bytes"])
        self.assertEqual(out["values"]["sdpa_backend"]["source"], "derived")  # not measured: kept
        self.assertEqual(out["name"], "h200-torch2.11")
        profiles.Profile(out)  # loads
        self.assertEqual(device_profile.extra_allocations([(1, 100), (2, 200), (3, 300), (4, 50)], {2, 4}), [100, 300])
        self.assertEqual(device_profile.profile_name("NVIDIA H200", "2.11.0+cu130"), "h200-torch2.11")
        self.assertEqual(device_profile.profile_name("NVIDIA A100-SXM4-80GB", "2.9.1"), "a100-sxm4-80gb-torch2.9")
        self.assertEqual(device_profile.sdpa_backend_of(["aten::_scaled_dot_product_flash_attention"]), "flash")
        self.assertEqual(device_profile.sdpa_backend_of(["aten::bmm"]), "math")


class GpuHistoryTest(unittest.TestCase):
    """The GPU mode's conversion of PyTorch's allocation history (no GPU or
    torch needed: the entries are the snapshot's dicts)."""

    def test_history_to_trace(self):
        from gpumem.predict import _child

        entries = [
            {"action": "free_requested", "addr": 7, "size": 64, "stream": 0},  # allocated before the history
            {"action": "alloc", "addr": 100, "size": 512, "stream": 0},
            {"action": "segment_alloc", "addr": 100, "size": 2 << 20, "stream": 0},
            {"action": "alloc", "addr": 200, "size": 1024, "stream": 93},
            {"action": "free_requested", "addr": 100, "size": 512, "stream": 0},
            {"action": "free_completed", "addr": 100, "size": 512, "stream": 0},
            {"action": "alloc", "addr": 100, "size": 512, "stream": 0},  # the address again: a new allocation
        ]
        rec = _child.history_to_recording(entries, [5, 7], "job", "torch x on y")
        self.assertEqual(rec.lines()[2], "# source torch x on y")
        self.assertEqual(rec.lines()[3:], ["a 0 512 0", "a 1 1024 93", "f 0", "# step 1", "a 2 512 0", "# step 2"])
        self.assertEqual(rec.steps, 2)
        self.assertEqual(rec.peak_live_bytes, 512 + 1024)


    def test_optimizer_frames_named_in_the_role(self):
        """An allocation made inside torch/optim has a role that says so,
        as tools/snapshot.c gives a pickle's (docs/predict.md, "Alignment")."""
        from gpumem.predict import _child

        user = {"filename": "/home/u/train.py", "line": 30, "name": "<module>"}
        adamw = {"filename": "/site-packages/torch/optim/adamw.py", "line": 200, "name": "_multi_tensor_adamw"}
        linear = {"filename": "/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
        self.assertRegex(_child.frames_role([adamw, user]), r"^optim/<module>@train\.py:30~[0-9a-f]{8}$")
        self.assertRegex(_child.frames_role([linear, user]), r"^<module>@train\.py:30~[0-9a-f]{8}$")
        self.assertIsNone(_child.frames_role([]))

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_gradscaler_takes_every_step(self):
        """A GradScaler skips the step whose gradients overflow; a GPU run
        takes it, so that the runs at each batch have the same steps (the
        CPU's GradScaler goes the same way as the GPU's)."""
        from torch.optim import optimizer as optim_module

        from gpumem.predict import _child

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        taken = []
        hook = optim_module.register_optimizer_step_post_hook(lambda o, a, k: taken.append(1))
        self.addCleanup(hook.remove)

        def step(scaler, value):
            scaler.scale(model(torch.full((2, 4), value)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        skipped = [0]
        with _child._every_step_taken(skipped):
            scaler = torch.amp.GradScaler("cpu")
            for value in (float("inf"), 1.0, 1.0):
                step(scaler, value)
        self.assertEqual((len(taken), skipped[0]), (3, 1))
        # outside, the scaler skips as it would
        step(torch.amp.GradScaler("cpu"), float("inf"))
        self.assertEqual(len(taken), 3)

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_backward_passes_counted_per_step(self):
        """Both routes count the backward passes of each step; a reentrant
        checkpoint's inner ones are not passes of their own."""
        from torch.utils.checkpoint import checkpoint

        from gpumem.predict import _child

        model = torch.nn.Linear(4, 4)
        x = torch.ones(2, 4, requires_grad=True)
        with _child._backwards_counted() as count:
            for _ in range(3):
                model(x).sum().backward()
            count.take()
            checkpoint(model, x, use_reentrant=True).sum().backward()
            count.take()
        self.assertEqual(count.per_step, [3, 1])
        self.assertEqual(torch.autograd._engine_run_backward.__module__, "torch.autograd.graph")  # (put back)

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_inference_loop_steps_on_either_route(self):
        """The helper both routes use: in a script with no training words,
        each DataLoader batch after the first ends a step, until a backward
        runs; in one with them, nothing is marked."""
        from gpumem.predict import _child

        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(10, 4)), batch_size=2)
        model = torch.nn.Linear(4, 1)
        with tempfile.TemporaryDirectory() as d:
            scripts = {}
            for name, text in (("infer", "for x in loader: model(x)\n"), ("train", "loss.backward()\n")):
                scripts[name] = os.path.join(d, name + ".py")
                with open(scripts[name], "w") as f:
                    f.write(text)
            marks, notes = [], []
            with _child._backwards_counted() as count, \
                    _child._inference_steps(scripts["infer"], lambda: marks.append(1), notes.append, count):
                for i, (x,) in enumerate(loader):
                    model(x)
                # (5 batches, 5 steps: each draw after the first ends one, the draw that finds
                # the loader empty included)
                self.assertEqual(len(marks), 5)
                model(x).sum().backward()
                for (x,) in loader:
                    model(x)
                self.assertEqual(len(marks), 5)  # (training: batches end no step)
            self.assertEqual(len(notes), 1)
            marks = []
            with _child._backwards_counted() as count, \
                    _child._inference_steps(scripts["train"], lambda: marks.append(1), notes.append, count):
                for (x,) in loader:
                    model(x)
            self.assertEqual(marks, [])
        from torch.utils.data import dataloader

        self.assertEqual(dataloader._BaseDataLoaderIter.__next__.__qualname__, "_BaseDataLoaderIter.__next__")

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_hand_written_update_is_a_step(self):
        """A GPU run marks a step where a loop updates its parameters by hand
        after a backward, at the next forward; an optimizer's step is not
        marked twice, and a forward under no_grad, or one with no update
        before it, marks nothing."""
        from gpumem.predict import _child

        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        marks, stepped = [], [False]

        def mark():
            stepped[0] = True
            marks.append(1)

        x = torch.ones(2, 4)
        with _child._hand_steps(mark, stepped):
            for _ in range(3):  # SGD by hand
                model(x).sum().backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
            self.assertEqual(len(marks), 2)  # (the third is marked by the next forward)
            with torch.no_grad():
                model(x)  # an evaluation
            self.assertEqual(len(marks), 2)
            model(x).sum().backward()  # the next step's forward marks the third
            self.assertEqual(len(marks), 3)
            model(x).sum().backward()  # no update since the last backward
            self.assertEqual(len(marks), 3)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            opt.step()
            stepped[0] = True  # (as run_gpu's optimizer hook does)
            model(x)
            self.assertEqual(len(marks), 3)
        model(x).sum().backward()
        with torch.no_grad():
            next(model.parameters()).add_(1)
        model(x)
        self.assertEqual(len(marks), 3)  # (outside, nothing is watched)

def predict_script(d, script, options, script_args, memory="80G"):
    """Writes script to d/train.py and runs `python -m gpumem.predict` on it
    at batch 1 and 2, two steps, on the CPU recorder, keeping the recordings
    in d/rec, with further options and the script's arguments.
    (the finished process, the recordings' directory, the script's path)"""
    path = os.path.join(d, "train.py")
    with open(path, "w") as f:
        f.write(script)
    out = os.path.join(d, "rec")
    done = subprocess.run(
        [sys.executable, "-m", "gpumem.predict", "--memory", memory, "--batch-sizes", "1,2", "--steps", "2",
         "--cpu", "--traces", out] + options + [path] + script_args,
        env=dict(os.environ, PYTHONPATH=PYTHON_DIR), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=900,
    )  # fmt: skip
    return done, out, path


# The top of a test script: torch, and --batch-size in a.batch_size.
SCRIPT_ARGS = ("import argparse, torch\n"
               "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); a = p.parse_args()\n")


def recordings(out):
    """[(meta, trace lines)] of the runs at batch 1 and 2 kept in out."""
    runs = []
    for b in ("b1", "b2"):
        with open(os.path.join(out, b, "meta.json")) as f:
            meta = json.load(f)
        with open(os.path.join(out, b, "trace")) as f:
            runs.append((meta, f.read().splitlines()))
    return runs


class CommandTest(unittest.TestCase):
    @unittest.skipIf(torch is None, NO_TORCH)
    def test_a_hand_written_update_is_training(self):
        # no optimizer: the parameters updated by hand under no_grad after each backward; the
        # next pass ends the step, and the script is stopped after --steps of them
        script = SCRIPT_ARGS + (
            "m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()\n"
            "for step in range(1000):\n"
            "    loss = m(torch.randn(a.batch_size, 64, device='cuda')).square().mean()\n"
            "    loss.backward()\n"
            "    with torch.no_grad():\n"
            "        for w in m.parameters():\n"
            "            w -= 0.01 * w.grad\n"
            "            w.grad = None\n"
        )
        with tempfile.TemporaryDirectory() as d:
            done, out, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            self.assertNotIn("inference", done.stdout.decode())
            for meta, lines in recordings(out):
                self.assertEqual((meta["steps"], meta["ended"]), (2, False))
                self.assertEqual(sum(line.startswith("# step") for line in lines), 2)

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_two_optimizers_make_one_step(self):
        # a GAN's loop: the discriminator's optimizer, then the generator's, whose pass is the
        # larger; --steps 2 takes two whole iterations (four optimizer steps), not one and a half
        script = SCRIPT_ARGS + (
            "G, D = torch.nn.Linear(8, 64).cuda(), torch.nn.Linear(64, 1).cuda()\n"
            "optG, optD = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())\n"
            "for it in range(1000):\n"
            "    D(torch.randn(a.batch_size, 64, device='cuda')).mean().backward(); optD.step(); optD.zero_grad()\n"
            "    D(G(torch.randn(4 * a.batch_size, 8, device='cuda'))).mean().backward(); optG.step(); optG.zero_grad()\n"
        )
        with tempfile.TemporaryDirectory() as d:
            done, out, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            for meta, lines in recordings(out):
                self.assertEqual(meta["steps"], 4)
                self.assertEqual(sum(line.startswith("# step") for line in lines), 4)
                # the second iteration's generator pass is in: G's activations at 4 x the batch
                last = lines.index("# step 3")
                self.assertTrue(any(line.startswith("a ") for line in lines[last:]))

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_an_evaluation_loop_stops_after_its_steps(self):
        # an inference script over a DataLoader of 4,000 samples: recorded whole, as many
        # iterations as batches (4,000 at batch 1) that did not align between the two batches;
        # now a step a batch, stopped after --steps
        script = SCRIPT_ARGS + (
            "m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()\n"
            "ds = torch.utils.data.TensorDataset(torch.randn(4000, 64))\n"
            "with torch.no_grad():\n"
            "    for (x,) in torch.utils.data.DataLoader(ds, batch_size=a.batch_size):\n"
            "        m(x.cuda()).argmax(-1)\n"
        )
        with tempfile.TemporaryDirectory() as d:
            done, out, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            self.assertIn("the script reads as inference", done.stdout.decode())
            for meta, lines in recordings(out):
                self.assertEqual((meta["steps"], meta["ended"]), (2, False))
                self.assertEqual(sum(line.startswith("a ") and line.rstrip().endswith(" argmax.default")
                                     for line in lines), 2)  # (each batch's answers: two batches recorded)

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_a_size_in_the_square_of_the_batch_takes_a_third_recording(self):
        # a contrastive loss's batch-by-batch logits: 4 and 16 bytes at 1 and 2, which a line
        # through two recordings put far too low at a large batch; a third fits the square
        script = SCRIPT_ARGS + (
            "m = torch.nn.Linear(64, 32).cuda()\n"
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "for step in range(3):\n"
            "    z = m(torch.randn(a.batch_size, 64, device='cuda'))\n"
            "    logits = z @ z.t()\n"
            "    torch.nn.functional.cross_entropy(logits, torch.arange(a.batch_size, device='cuda')).backward()\n"
            "    opt.step(); opt.zero_grad()\n"
        )
        with tempfile.TemporaryDirectory() as d:
            done, out, _ = predict_script(d, script, ["--no-confirm", "--batch", "4096"], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            text = done.stdout.decode()
            self.assertIn("recorded at batch 1, 2, 4 ", text)
            self.assertIn("grew faster than the batch from 1 to 2 (nearer its square than a line), so the job was "
                          "recorded at 4 too", text)
            self.assertEqual(sorted(os.listdir(out))[:3], ["b1", "b2", "b4"])
            # at 4096 the logits alone are 64 MiB, and their softmax and gradients as much again:
            # a line through 1 and 2 gave them a few KiB
            peak = float(re.search(r"^pytorch +[0-9]+ +([0-9.]+) GiB", text, re.M).group(1))
            self.assertGreater(peak, 0.25, text)

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_a_batch_size_in_a_configuration_file(self):
        # a script that reads its batch size from a JSON file (HF's run_*.py take one as their
        # only argument) was refused: no {B} in its arguments; a copy of the file with {B} in it
        # is now filled in for each run, and the user's file is left as it was
        script = (
            "import json, sys, torch\n"
            "cfg = json.load(open(sys.argv[1].split('=', 1)[-1]))\n"
            "m = torch.nn.Linear(64, 10).cuda()\n"
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "for step in range(3):\n"
            "    m(torch.randn(cfg['batch_size'], 64, device='cuda')).sum().backward(); opt.step(); opt.zero_grad()\n"
        )
        with tempfile.TemporaryDirectory() as d:
            config = os.path.join(d, "cfg.json")
            with open(config, "w") as f:
                f.write('{"batch_size": {B}, "lr": 0.1}\n')
            for arg in (config, "--config=" + config):
                done, out, _ = predict_script(d, script, ["--no-confirm"], [arg])
                self.assertEqual(done.returncode, 0, done.stderr.decode())
                for b in (1, 2):
                    with open(os.path.join(out, "b%d" % b, "args0", "cfg.json")) as f:
                        self.assertEqual(json.load(f), {"batch_size": b, "lr": 0.1})
                shutil.rmtree(out)
            with open(config) as f:
                self.assertEqual(f.read(), '{"batch_size": {B}, "lr": 0.1}\n')
            with open(config, "w") as f:
                f.write('{"batch_size": 8}\n')
            done, _, _ = predict_script(d, script, ["--no-confirm"], [config])
            self.assertEqual(done.returncode, 2)
            self.assertIn("or a configuration file named in them (a copy of the script's own, JSON or YAML) does",
                          done.stderr.decode())

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_a_dataset_shorter_than_the_batch_with_drop_last(self):
        # with drop_last=True a batch past the dataset's length gives no batch at all: the check
        # failed there and the table kept the scaled answer, a batch the script cannot run; now
        # the dataset's length is the largest batch
        script = SCRIPT_ARGS + (
            "m = torch.nn.Linear(64, 10).cuda()\n"
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "ds = torch.utils.data.TensorDataset(torch.randn(40, 64))\n"
            "for epoch in range(3):\n"
            "    for (x,) in torch.utils.data.DataLoader(ds, batch_size=a.batch_size, drop_last=True):\n"
            "        m(x.cuda()).sum().backward(); opt.step(); opt.zero_grad()\n"
        )
        with tempfile.TemporaryDirectory() as d:
            done, _, _ = predict_script(d, script, [], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            text = done.stdout.decode()
            self.assertIn("with drop_last=True a larger one gives no batch at all", text)
            self.assertEqual(text.count("40 (dataset)"), 5, text)

    @unittest.skipIf(torch is None or transformers is None, "needs PyTorch and transformers")
    def test_a_checkpoint_loaded_onto_the_gpu_by_device_map(self):
        # from_pretrained(..., device_map="auto") names the device 0, which a CPU build cannot
        # make a device of, and loads the weights in worker threads, where the recorder's modes
        # do not reach: both stopped the recording at its first line
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
        script = (
            "import argparse, os, torch\n"
            "from transformers import AutoModelForCausalLM\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); a = p.parse_args()\n"
            "path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'model')\n"
            "m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, device_map='auto')\n"
            "assert str(m.device) == 'cuda:0' and torch.device(0).type == 'cuda', m.device\n"
            "opt = torch.optim.AdamW(m.parameters())\n"
            "for step in range(1000):\n"
            "    ids = torch.randint(0, 256, (a.batch_size, 16), device=0)\n"
            "    m(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()\n"
        )
        with tempfile.TemporaryDirectory() as d:
            transformers.LlamaForCausalLM(cfg).save_pretrained(os.path.join(d, "model"))
            done, out, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            with open(os.path.join(out, "b1", "trace")) as f:
                self.assertEqual(sum(line.startswith("# step") for line in f), 2)
            # transformers 5.25 on loads layer kernels from the Hub onto a GPU, which fake
            # tensors cannot run (it stopped the recording): off, and said so
            if importlib.util.find_spec("kernels") is not None:
                self.assertIn("(USE_HUB_KERNELS=NO)", done.stdout.decode())

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_accumulation_to_a_global_batch_is_named(self):
        # micro-batches of --batch-size accumulated to a global batch of 4: 4 backward passes a
        # step at batch 1, 2 at batch 2; the recordings cannot align, and the message says why
        # and what to give the script
        script = (
            "import argparse, torch\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int)\n"
            "p.add_argument('--global-batch', type=int, default=4); a = p.parse_args()\n"
            "m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()\n"
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "for step in range(1000):\n"
            "    for micro in range(a.global_batch // a.batch_size):\n"
            "        m(torch.randn(a.batch_size, 64, device='cuda')).square().mean().backward()\n"
            "    opt.step(); opt.zero_grad()\n"
        )
        with tempfile.TemporaryDirectory() as d:
            done, out, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            self.assertNotEqual(done.returncode, 0)
            self.assertIn("the script runs 4 and 2 backward passes a step at batch 1 and 2", done.stderr.decode())
            for (meta, _), n in zip(recordings(out), (4, 2)):
                self.assertEqual(meta["backwards_per_step"], [n, n])
            # as it says: the global batch as {B} too, one backward a step
            done, _, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}", "--global-batch", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_saves_write_nothing(self):
        # a script that saves a checkpoint each step: its files stay as they were (on fake
        # tensors torch.save wrote a broken file and stopped the run), and a note says so
        script = (
            "import argparse, os, torch\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); a = p.parse_args()\n"
            "m = torch.nn.Linear(64, 10).cuda()\n"
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "for step in range(1000):\n"
            "    m(torch.randn(a.batch_size, 64, device='cuda')).square().mean().backward()\n"
            "    opt.step(); opt.zero_grad()\n"
            "    torch.save({'model': m.state_dict(), 'opt': opt.state_dict()},\n"
            "               os.path.join(os.path.dirname(os.path.abspath(__file__)), 'ckpt.pt'))\n"
        )
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "ckpt.pt"), "wb") as f:
                f.write(b"the user's checkpoint")
            done, out, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            with open(os.path.join(d, "ckpt.pt"), "rb") as f:
                self.assertEqual(f.read(), b"the user's checkpoint")
            self.assertIn("the script's checkpoints were neither written nor removed while it was recorded (1 call, "
                          "the first for %s)" % os.path.join(d, "ckpt.pt"), done.stdout.decode())

    @unittest.skipIf(torch is None or transformers is None, "needs PyTorch and transformers")
    def test_a_trainers_checkpoints_leave_the_users_alone(self):
        # the HF Trainer saving each step and keeping one checkpoint: run as it is, each
        # recording's rotation deleted the checkpoint-500 the user's own training left
        script = (
            "import argparse, sys, torch\n"
            "from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); a = p.parse_args()\n"
            "class Tokens(torch.utils.data.Dataset):\n"
            "    def __len__(self): return 64\n"
            "    def __getitem__(self, i): return {'input_ids': torch.arange(16), 'labels': torch.tensor(i % 2)}\n"
            "cfg = BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,\n"
            "                 vocab_size=100)\n"
            "args = TrainingArguments(output_dir=sys.argv[0] + '.out', per_device_train_batch_size=a.batch_size,\n"
            "                         max_steps=10, report_to=[], save_strategy='steps', save_steps=1,\n"
            "                         save_total_limit=1, disable_tqdm=True)\n"
            "Trainer(model=BertForSequenceClassification(cfg), args=args, train_dataset=Tokens()).train()\n"
        )
        with tempfile.TemporaryDirectory() as d:
            kept = os.path.join(d, "train.py.out", "checkpoint-500")
            os.makedirs(kept)
            with open(os.path.join(kept, "model.safetensors"), "wb") as f:
                f.write(b"the user's weights")
            done, _, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            self.assertEqual(os.listdir(os.path.join(d, "train.py.out")), ["checkpoint-500"])
            with open(os.path.join(kept, "model.safetensors"), "rb") as f:
                self.assertEqual(f.read(), b"the user's weights")
            self.assertIn("were neither written nor removed", done.stdout.decode())

    def test_equal_notes_are_folded(self):
        note = "a sum of a bfloat16 tensor of %s elements: its staging buffers, if any (at most %s bytes, given " \
               "back within the call), are not in the trace"
        folded = command.fold_notes([note % ("4,096", "32768"), "something else at x.py:3",
                                     note % ("1,048,576", "524280"), note % ("65536", "524280")])
        self.assertEqual(folded, [note % ("4,096 to 1,048,576", "32,768 to 524,280") +
                                  " (3 of them; at most 0.000 GiB above the trace at any moment)",
                                  "something else at x.py:3"])
        # bounds of buffers that may be live together add up
        kept = "a cache of %s entries (at most %s bytes, kept until the end) is not in the trace"
        self.assertEqual(command.fold_notes([kept % ("4", str(3 << 29)), kept % ("8", str(3 << 29))]),
                         [kept % ("4 to 8", "1,610,612,736") + " (2 of them; at most 3.000 GiB together)"])
        self.assertEqual(command.fold_notes(["one at a.py:1", "one at a.py:1"]), ["one at a.py:1 (2 of them)"])
        self.assertEqual(command.fold_notes(["read at utils.py:396", "read at utils.py:3883"]),
                         ["read at utils.py:396 to 3883 (2 of them)"])

    def test_the_users_line_in_a_log(self):
        from gpumem.predict import runs

        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "train.py")
            log = "\n".join([
                "  0%|          | 0/10 [00:00<?, ?it/s]Traceback (most recent call last):",
                '  File "%s", line 16, in <module>' % script,
                "    Trainer(model=m).train()",
                '  File "/usr/lib/python3/site-packages/transformers/trainer.py", line 99, in train',
                "    return self.loop()",
                "AttributeError: 'T5Config' object has no attribute 'decoder_start_token_id'",
                "  ",
                "  0%|          | 0/10 [00:01<?, ?it/s]",
            ])  # fmt: skip
            frame, error = runs.user_frame(log, script)
        self.assertEqual(frame, "%s:16 in <module>" % script)
        self.assertEqual(error, "AttributeError: 'T5Config' object has no attribute 'decoder_start_token_id'")
        self.assertEqual(runs.user_frame("no traceback here", script), (None, None))

    def test_sizes(self):
        self.assertEqual(command.parse_size("80G"), 80 << 30)
        self.assertEqual(command.parse_size("1.5GiB"), 3 << 29)
        self.assertEqual(command.parse_size("4096B"), 4096)
        with self.assertRaisesRegex(ValueError, "with a unit"):
            command.parse_size("80")
        self.assertEqual(command.parse_sizes("1,2"), [1, 2])
        for bad in ("1", "2,2", "0,1", "a,b"):
            with self.assertRaises(ValueError):
                command.parse_sizes(bad)

    def test_rows_and_table(self):
        # (the shape of `gpumem predict --json`, docs/predict.md)
        text = json.dumps({"batch": 64, "allocators": [
            {"allocator": "pytorch", "largest_batch": 40, "peak_reserved_bytes": 90 << 30},
            {"allocator": "gpumem default", "largest_batch": 48, "peak_reserved_bytes": 70 << 30},
        ]})  # fmt: skip
        rows = command.parse_rows(text)
        self.assertEqual([r["max_batch"] for r in rows], [40, 48])
        with self.assertRaisesRegex(ValueError, "no 'allocators' list"):
            command.parse_rows(json.dumps([{"allocator": "pytorch"}]))
        self.assertIsNone(command.check_line(text))  # two recordings: no check
        checked = json.dumps({"allocators": [], "check": {"batch": 8, "allocations": 10, "exact": 9,
                                                          "recorded_peak_live_bytes": 2 << 30,
                                                          "predicted_peak_live_bytes": 2 << 30}})  # fmt: skip
        self.assertEqual(command.check_line(checked), "check: batch 8 predicted from the smaller ones: 9 of 10 "
                         "allocations to the byte; peak live 2.000 GiB predicted, 2.000 GiB recorded")
        out = command.table("train.py", [1, 2], "cpu", 80 << 30, 1 << 29, "estimate", rows, ["a note"], 64)
        self.assertIn("peak reserved at batch 64", out)
        self.assertIn("gpumem default         48             70.000 GiB", out)
        self.assertIn("the CUDA context takes 0.500 GiB (estimate), leaving 79.500 GiB", out)
        self.assertIn("  - a note", out)

    def test_usage_errors(self):
        env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
        run = [sys.executable, "-m", "gpumem.predict", "--memory", "80G"]
        done = subprocess.run(run + [__file__, "--batch-size", "8"], env=env, stderr=subprocess.PIPE)
        self.assertEqual(done.returncode, 2)
        self.assertIn(b"{B}", done.stderr)
        done = subprocess.run(run[:-1] + ["80", __file__, "{B}"], env=env, stderr=subprocess.PIPE)
        self.assertEqual(done.returncode, 2)
        self.assertIn(b"with a unit", done.stderr)

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_script_end_to_end_on_the_cpu(self):
        script = (
            "import argparse, torch\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); a = p.parse_args()\n"
            "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))\n"
            "model.to(dev)\n"
            "opt = torch.optim.AdamW(model.parameters())\n"
            "for step in range(1000):\n"
            "    x = torch.randn(a.batch_size, 64).to(dev)\n"
            "    y = torch.randint(0, 10, (a.batch_size,)).cuda()\n"
            "    loss = torch.nn.functional.cross_entropy(model(x), y)\n"
            "    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)\n"
            "    print('loss', loss.item())\n"
        )
        with tempfile.TemporaryDirectory() as d:
            # the check at the batches themselves (on by default on the CPU recorder), three recordings
            done, out, _ = predict_script(d, script, ["--batch", "64", "--confirm-runs", "3"],
                                          ["--batch-size", "{B}"], memory="1G")  # fmt: skip
            err = done.stderr.decode()
            traces = []
            for b in (1, 2):
                with open(os.path.join(out, "b%d" % b, "trace")) as f:
                    lines = f.read().splitlines()
                traces.append(parse(lines))
                # the recording ends with its last step: what dies while the script unwinds
                # (the model, its optimizer: when is up to Python's collector) is not in it
                self.assertEqual(lines[-1], "# step 2")
                with open(os.path.join(out, "b%d" % b, "meta.json")) as f:
                    self.assertEqual(json.load(f)["steps"], 2)
            self.assertIn(64 * 4 * b, traces[1][0].values())  # x at batch 2
            self.assertEqual(traces[0][2], 2)
            # a model this small is followed value by value (values.py): the loss read is its value
            self.assertFalse(any("placeholder" in n for n in traces[0][3]), traces[0][3])
            binary = _cli.find()
            if binary is None or "has no `predict` command" in err:
                self.assertEqual(done.returncode, 1, err)
                self.assertIn("the recordings are in", err)
                self.skipTest("the gpumem binary has no `predict` command: the table is not checked (%s)"
                              % (binary or "no binary"))  # fmt: skip
            self.assertEqual(done.returncode, 0, err)
            text = done.stdout.decode()
            for name in ("pytorch", "cudaMallocAsync"):
                self.assertIn(name, text)
            self.assertIn("checked with the CPU recorder at batch 64, ", text)
            self.assertIn("3 recordings replayed", text)
            self.assertIn("ran out of recordings (--confirm-runs)", text)
            self.assertTrue(os.path.exists(os.path.join(out, "at_b64", "trace")))

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_the_scripts_own_memory_fraction_is_answered_for(self):
        script = (
            "import argparse, torch\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); p.add_argument('--cap', type=float)\n"
            "a = p.parse_args()\n"
            "if a.cap: torch.cuda.set_per_process_memory_fraction(a.cap)\n"
            "m = torch.nn.Linear(1024, 1024).cuda(); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "for step in range(100):\n"
            "    m(torch.randn(a.batch_size, 1024, device='cuda')).square().sum().backward()\n"
            "    opt.step(); opt.zero_grad()\n"
        )
        largest = {}
        for cap in (None, 0.5):
            with tempfile.TemporaryDirectory() as d:
                extra = ["--cap", str(cap)] if cap else []
                done, _, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"] + extra, memory="4G")
                err, text = done.stderr.decode(), done.stdout.decode()
                if _cli.find() is None:
                    self.skipTest("no gpumem binary (make build)")
                self.assertEqual(done.returncode, 0, err)
                line = [x for x in text.splitlines() if x.startswith("pytorch ")][0]
                largest[cap] = int(line.split()[1])
                if cap:
                    self.assertIn("the script caps PyTorch at 0.5 of the device "
                                  "(torch.cuda.set_per_process_memory_fraction): the table answers for 2.000 GiB", text)
                else:
                    self.assertNotIn("caps PyTorch", text)
        # the batch's bytes (inputs, outputs, gradients) scale with it: 2 GiB of the 3.4 the context
        # leaves, about 2/3.4 of the batch
        self.assertLess(largest[0.5], 0.65 * largest[None])
        self.assertGreater(largest[0.5], 0.5 * largest[None])

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_a_process_group_without_gpus_is_pointed_to_it(self):
        # a single-GPU script that starts an NCCL group of one: without --gpus, the run fails where
        # NCCL is missing, and the error says which option records it
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            self.skipTest("NCCL is built in here: the group would start")
        script = (
            "import argparse, os, torch, torch.distributed as dist\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); a = p.parse_args()\n"
            "os.environ.setdefault('MASTER_ADDR', '127.0.0.1'); os.environ.setdefault('MASTER_PORT', '29533')\n"
            "dist.init_process_group('nccl', rank=0, world_size=1)\n"
        )
        with tempfile.TemporaryDirectory() as d:
            done, _, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
        err = done.stderr.decode()
        self.assertEqual(done.returncode, 1, err)
        self.assertIn("the script starts a process group (torch.distributed.init_process_group): record it with "
                      "--gpus 1", err)

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_a_script_that_installs_gpumem_itself_is_recorded(self):
        # the README's way in: gpumem.torch.enable() at the top. On fake tensors torch has no CUDA
        # allocator to replace; the run is recorded as any other, and the note says what it asked
        script = ("import gpumem.torch\ngpumem.torch.enable('limit:40G')\n" + SCRIPT_ARGS +
                  "w = torch.nn.Linear(64, 64).cuda()\nopt = torch.optim.SGD(w.parameters(), lr=0.1)\n"
                  "for _ in range(3):\n"
                  "    w(torch.randn(a.batch_size, 64, device='cuda')).sum().backward(); opt.step(); opt.zero_grad()\n")  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            done, out, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            runs = recordings(out)
        text = done.stdout.decode()
        self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
        self.assertIn("the script installs gpumem itself (gpumem.torch.enable('limit:40G')): recorded as it asks "
                      "PyTorch for memory, which each allocator's row replays; its settings are not applied to the "
                      "gpumem rows, which stand for the default", text)  # fmt: skip
        self.assertTrue(all(any(line.startswith("a ") for line in lines) for _, lines in runs))

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_a_module_that_prints_as_it_is_imported(self):
        # the recording process imports the script's imports before it says it is ready, on the
        # line the command reads: a banner printed there stopped the command with a traceback
        script = SCRIPT_ARGS.replace("import argparse, torch\n", "import argparse, torch\nimport noisy\n") + (
            "m = torch.nn.Linear(64, 10).cuda()\n"
            "for _ in range(3):\n"
            "    m(torch.randn(a.batch_size, 64, device='cuda')).sum().backward()\n"
        )
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "noisy.py"), "w") as f:
                f.write("print('a banner from a library')\n")
            done, out, _ = predict_script(d, script, ["--no-confirm"], ["--batch-size", "{B}"])
            self.assertEqual(done.returncode, 0, done.stderr.decode())
            self.assertNotIn("Traceback", done.stderr.decode())
            self.assertIn("gpumem default", done.stdout.decode())
            with open(os.path.join(out, "server.log")) as f:
                self.assertIn("a banner from a library", f.read())

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_a_failed_run_keeps_the_log_it_names(self):
        # with no --traces the recordings are in a temporary directory, removed at the end;
        # not when the error names a file in it
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "train.py")
            with open(path, "w") as f:
                f.write("import sys\nraise RuntimeError('the job fails here')\n")
            done = subprocess.run(
                [sys.executable, "-m", "gpumem.predict", "--memory", "1G", "--cpu", "--jobs", "1", path, "{B}"],
                env=dict(os.environ, PYTHONPATH=PYTHON_DIR), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                timeout=300,
            )  # fmt: skip
        err = done.stderr.decode()
        self.assertEqual(done.returncode, 1, err)
        self.assertIn("the job fails here", err)
        log = re.search(r"the whole output: (\S+)", err)
        self.assertIsNotNone(log, err)
        root = os.path.dirname(os.path.dirname(log.group(1)))
        self.assertTrue(os.path.basename(root).startswith("gpumem-predict-"), root)
        try:
            with open(log.group(1)) as f:
                self.assertIn("the job fails here", f.read())
        finally:
            shutil.rmtree(root, ignore_errors=True)

    @unittest.skipIf(torch is None or transformers is None, "needs PyTorch and transformers")
    def test_hf_trainer_on_the_cpu(self):
        # A job as HF Trainer users write it: Accelerate places the batches. Both recordings
        # must hold the model and the batches on the fake GPU, and align.
        try:
            import accelerate  # noqa: F401
        except ImportError:
            self.skipTest("needs accelerate (pip install accelerate), which the Trainer needs")
        script = textwrap.dedent("""\
            import argparse, torch
            from torch.utils.data import Dataset
            from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
            p = argparse.ArgumentParser(); p.add_argument("--bs", type=int); p.add_argument("--out"); a = p.parse_args()
            class Rand(Dataset):
                def __len__(self): return 1000
                def __getitem__(self, i):
                    g = torch.Generator().manual_seed(i)
                    return {"input_ids": torch.randint(0, 1000, (32,), generator=g), "labels": torch.tensor(i % 2)}
            cfg = BertConfig(vocab_size=1000, num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                             intermediate_size=128)
            args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=a.bs, max_steps=20,
                                     report_to=[], save_strategy="no", disable_tqdm=True)
            Trainer(model=BertForSequenceClassification(cfg), args=args, train_dataset=Rand()).train()
            """)
        with tempfile.TemporaryDirectory() as d:
            done, out, _ = predict_script(d, script, ["--batch", "64", "--no-confirm"],
                                          ["--bs", "{B}", "--out", os.path.join(d, "trainer")])  # fmt: skip
            err = done.stderr.decode()
            self.assertNotIn("same device", err)
            for b in (1, 2):
                with open(os.path.join(out, "b%d" % b, "meta.json")) as f:
                    self.assertEqual(json.load(f)["steps"], 2, err)
            if _cli.find() is None:
                self.skipTest("no gpumem binary (make build): the table is not checked")
            self.assertEqual(done.returncode, 0, err)
            text = done.stdout.decode()
            self.assertIn("gpumem default", text)
            self.assertNotIn("differ", text)

    def command_with_traces(self, trace_lines, argv, meta, gpu=False):
        """(exit status, stdout, [(mode, batch)] recorded): the command run
        in this process, its `record` stood in for by one that writes
        trace_lines(mode, batch) as the recording, with meta as its meta.json."""
        if _cli.find() is None:
            self.skipTest("no gpumem binary (make build)")
        calls = []

        def fake_record_points(pool, points, mode, root, prefix):
            metas = []
            for b, seq_len in points:
                calls.append((mode, b))
                out_dir = os.path.join(root, "%s%d" % (prefix, b))
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, "trace"), "w") as f:
                    f.write("\n".join(["# gpumem-trace v1"] + trace_lines(mode, b)) + "\n")
                metas.append(dict(meta(mode), path=os.path.join(out_dir, "trace"), steps=2))
            return metas

        saved = command.record_points, command._gpu_available, command._local_gpu
        command.record_points = fake_record_points
        command._local_gpu = lambda: ("NVIDIA H200" if gpu else None, "2.11.0")
        if gpu:
            command._gpu_available = lambda: True
        out = io.StringIO()
        try:
            with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(io.StringIO()):  # fmt: skip
                rc = command.main(argv + ["--traces", d, __file__, "--batch-size", "{B}"])
        finally:
            command.record_points, command._gpu_available, command._local_gpu = saved
        return rc, out.getvalue(), calls

    def test_gpu_runs_with_requests_at_one_batch_only_are_aligned(self):
        # On the GPU, a kernel may pick its algorithm by size (embedding's backward sorts its
        # indices past 3072 of them): batch 4 makes six buffers the others do not. They are
        # matched as diff matches lines, the extra ones carried in proportion to the batch,
        # and the table says so, as a bound.
        def trace_lines(mode, b):
            lines = ["a 0 %d 0" % (b << 20), "# step 1", "a 1 %d 0" % (b << 21)]
            # (a layer's sixty short-lived buffers beside them)
            lines += ["a %d %d 0\nf %d" % (100 + k, b << 12, 100 + k) for k in range(60)]
            if mode == "gpu" and b == 4:  # a sort's six buffers, at batch 4 only
                lines += ["a %d 4096 0" % k for k in range(10, 16)] + ["f %d" % k for k in range(15, 9, -1)]
            return lines + ["a 2 %d 0" % (b << 21), "f 1", "f 2", "# step 2"]

        def meta(mode):
            return {"notes": ["seen in %s mode" % mode], "context_bytes": 1 << 28, "context_source": "measured",
                    "device": "NVIDIA H200"}  # fmt: skip

        rc, text, calls = self.command_with_traces(
            trace_lines, ["--memory", "1G", "--batch-sizes", "1,2,4", "--batch", "16", "--no-confirm"], meta, gpu=True)
        self.assertEqual(rc, 0, text)
        self.assertEqual(calls, [("gpu", 1), ("gpu", 2), ("gpu", 4)])
        self.assertIn("the recordings were aligned by what made each allocation: 6 allocations only larger "
                      "batches make (0.000 GiB at the largest): each taken in proportion to the batch, an upper "
                      "bound", text)
        # at batch 16: 16 MiB of weights and two 32 MiB activations live together, and a 64 KiB buffer
        self.assertRegex(text, r"pytorch +\d+ +0\.080 GiB")

    def test_recordings_that_never_align_are_answered_at_the_batches(self):
        # a loop over the images of a batch (a detection model): one allocation per image, so no
        # two batch sizes align; on fake tensors the figures come from the batches themselves
        def trace_lines(mode, b):
            lines = ["a 0 %d 0" % (64 << 20), "# step 1"]
            per_image = [1 << 20, 1 << 20, 1 << 20, 1 << 19, 1 << 19]  # 4 MiB in five allocations
            ids = [(10 + 5 * i + k, size) for i in range(b) for k, size in enumerate(per_image)]
            lines += ["a %d %d 0" % (i, size) for i, size in ids] + ["a 1 %d 0" % (1 << 20)]  # then the loss
            return lines + ["f %d" % i for i, _ in ids] + ["f 1", "# step 2"]

        rc, text, calls = self.command_with_traces(
            trace_lines, ["--cpu", "--memory", "1G", "--batch-sizes", "2,4", "--batch", "16"],
            lambda mode: {"notes": [], "context_bytes": 0, "context_source": "estimate"})
        self.assertEqual(rc, 0, text)
        self.assertIn("the recordings at batch 2, 4 do not align, so every figure is from recordings at the "
                      "batches themselves: the recordings differ", text)
        self.assertIn(("cpu", 16), calls)
        self.assertNotIn("scaled from the small runs", text)
        # 64 MiB of weights, 4 MiB per image and the loss's 1 MiB: at 16, 129 MiB and PyTorch's
        # rounding; 1 GiB holds at most 239 images
        m = re.search(r"^pytorch +(\d+) +(0\.\d+) GiB", text, re.M)
        self.assertIsNotNone(m, text)
        self.assertTrue(225 <= int(m.group(1)) <= 239, text)
        self.assertTrue(0.126 <= float(m.group(2)) <= 0.130, text)

    def test_upper_bounds_are_said_above_the_table(self):
        rows = [{"allocator": "pytorch", "max_batch": 7, "peak_reserved_bytes": 1 << 30}]
        note = "nonzero() (boolean masks) at det.py:10 assumed every element true: its size is an upper bound"
        text = command.table("det.py", [2, 4], "cpu", 8 << 30, 0, "estimate", rows, [note], 16)
        self.assertIn("upper bounds: sizes that depend on tensor values", text.splitlines()[2])
        self.assertNotIn("upper bounds", command.table("a.py", [2, 4], "cpu", 8 << 30, 0, "estimate", rows, [], 16))

    def test_sequence_length_usage_errors(self):
        env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
        run = [sys.executable, "-m", "gpumem.predict", "--memory", "80G"]
        cases = (
            (["--seq-lens", "8,16,32"], ["--batch-size", "{B}", "--len", "{L}"], b"go together"),
            (["--seq-lens", "8", "--seq-len", "64"], ["--batch-size", "{B}", "--len", "{L}"], b"bad --seq-lens"),
            (["--seq-lens", "8,16", "--seq-len", "64"], ["--batch-size", "{B}"], b"need {L}"),
            ([], ["--batch-size", "{B}", "--len", "{L}"], b"no --seq-lens"),
        )
        for opts, args, why in cases:
            done = subprocess.run(run + opts + [__file__] + args, env=env, stderr=subprocess.PIPE)
            self.assertEqual(done.returncode, 2, (opts, args))
            self.assertIn(why, done.stderr, (opts, args))

    @unittest.skipIf(torch is None, NO_TORCH)
    def test_batch_and_sequence_length_on_the_cpu(self):
        # a token model: embeddings and a vocabulary head over B x L tokens
        script = (
            "import argparse, torch\n"
            "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int); p.add_argument('--len', type=int)\n"
            "a = p.parse_args()\n"
            "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256), torch.nn.GELU(),\n"
            "                            torch.nn.Linear(256, 512)).to(dev)\n"
            "opt = torch.optim.AdamW(model.parameters())\n"
            "for step in range(1000):\n"
            "    x = torch.randint(0, 512, (a.batch_size, a.len), device=dev)\n"
            "    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())\n"
            "    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)\n"
        )
        binary = _cli.find()
        if binary is None:
            self.skipTest("no gpumem binary: the passes of `gpumem predict` cannot run")
        with tempfile.TemporaryDirectory() as d:
            done, out, path = predict_script(d, script, ["--batch", "8", "--seq-lens", "8,16,32", "--seq-len", "64",
                                                         "--no-confirm"],
                                             ["--batch-size", "{B}", "--len", "{L}"])  # fmt: skip
            err, text = done.stderr.decode(), done.stdout.decode()
            self.assertEqual(done.returncode, 0, err)
            self.assertIn("recorded at batch 1, 2 x length 8, 16, 32, predicted at length 64", text)
            self.assertIn("peak reserved at batch 8", text)
            self.assertNotIn("checked with the CPU recorder", text)  # --no-confirm
            # the first pass: batch 2 written at length 64 is what a run there records
            direct = command.record(path, ["--batch-size", "{B}", "--len", "{L}"], 2, os.path.join(d, "direct"),
                                    "cpu", 2, "h200", seq_len=64)  # fmt: skip
            def sizes(name):
                with open(name) as f:
                    return [int(line.split()[2]) for line in f if line.startswith("a ")]

            got, want = sizes(os.path.join(out, "b2_L64.trace")), sizes(direct["path"])
            self.assertEqual(got, want)
            self.assertIn(2 * 64 * 512 * 4, got)  # the logits at batch 2, length 64, fp32


if __name__ == "__main__":
    unittest.main()
