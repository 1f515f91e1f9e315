"""gpumem.torch.microbatch on the CPU: a step whose batch does not fit (an
out-of-memory error raised by a stand-in cap on the rows a forward pass may
take) finishes as micro-batches, and its parameters equal, bit for bit, those
of a plain loop that accumulates the same micro-batches. Needs PyTorch (the
CPU build does); skipped without it."""

import os
import subprocess
import sys
import tempfile
import unittest
import warnings

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

if torch is not None:
    from gpumem.microbatch import CannotSplitError, MicroBatchStep, _sizes


def _model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 3)
    )


def _data(steps, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


class _Cap:
    """Raises PyTorch's out-of-memory error after the forward pass of a
    micro-batch of more than `rows` rows (so a failed attempt has used the
    random number generator, as a real one would)."""

    def __init__(self, rows, torch_error=True):
        self.rows = rows
        self.raised = 0
        self.torch_error = torch_error

    def check(self, m):
        if m > self.rows:
            self.raised += 1
            text = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 1.00 GiB"
            raise torch.OutOfMemoryError(text) if self.torch_error else RuntimeError(text)


def _reference(model, opt, data, k, autocast=None, scaler=None):
    """The plain loop: k micro-batches, each loss scaled by its share."""
    for x, y in data:
        n = x.shape[0]
        opt.zero_grad(set_to_none=True)
        for xs, ys, m in zip(x.split(_sizes(n, k)), y.split(_sizes(n, k)), _sizes(n, k)):
            if autocast:
                with torch.autocast("cpu", dtype=autocast):
                    out = model(xs)
            else:
                out = model(xs)
            loss = torch.nn.functional.cross_entropy(out, ys)
            scaled = loss * (m / n)
            (scaler.scale(scaled) if scaler else scaled).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return model


@unittest.skipIf(torch is None, "needs PyTorch (pip install torch: the CPU build will do)")
class MicroBatchTest(unittest.TestCase):
    def setUp(self):
        torch.use_deterministic_algorithms(True)

    def tearDown(self):
        torch.use_deterministic_algorithms(False)

    def run_capped(self, cap, data, dropout=0.0, autocast=None, scaler=None, **kw):
        model = _model(dropout=dropout)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def loss_fn(batch):
            x, y = batch
            if autocast:
                with torch.autocast("cpu", dtype=autocast):
                    out = model(x)
            else:
                out = model(x)
            cap.check(x.shape[0])
            return torch.nn.functional.cross_entropy(out, y)

        step = MicroBatchStep(loss_fn, opt, model=model, scaler=scaler, **kw)
        losses = [step(b) for b in data]
        return model, step, losses

    def assert_same_parameters(self, a, b):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            self.assertTrue(torch.equal(p, q), "parameter %s differs" % name)

    def test_fp32_equals_the_accumulating_loop_bit_for_bit(self):
        data = _data(6, 16)
        cap = _Cap(rows=5)  # 16 rows do not fit; 4 micro-batches of 4 do
        model, step, losses = self.run_capped(cap, data, dropout=0.1)
        self.assertEqual(step.last_k, 4)
        self.assertEqual(step.steps, 6)
        self.assertEqual(step.ooms, 2)  # k = 1 and k = 2 were thrown away, once
        self.assertEqual(cap.raised, 2)
        ref = _model(dropout=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        _reference(ref, ref_opt, data, 4)
        self.assert_same_parameters(model, ref)
        self.assertTrue(all(loss.dim() == 0 for loss in losses))

    def test_uneven_micro_batches_keep_the_effective_batch(self):
        data = _data(3, 10)
        model, step, _ = self.run_capped(_Cap(rows=3), data)
        self.assertEqual(step.last_k, 4)  # 3, 3, 2, 2 rows
        ref = _model()
        _reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, 4)
        self.assert_same_parameters(model, ref)

    def test_runtime_error_of_pytorchs_text_counts_as_out_of_memory(self):
        model, step, _ = self.run_capped(_Cap(rows=8, torch_error=False), _data(2, 16))
        self.assertEqual(step.last_k, 2)

    def test_bf16_autocast_with_grad_scaler(self):
        data = _data(4, 16)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        model, step, _ = self.run_capped(_Cap(rows=8), data, autocast=torch.bfloat16, scaler=scaler)
        self.assertEqual(step.last_k, 2)
        ref = _model()
        _reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, 2, autocast=torch.bfloat16,
                   scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
        self.assert_same_parameters(model, ref)

    def test_smaller_k_is_tried_again_after_retry_after_steps(self):
        cap = _Cap(rows=8)
        model, step, _ = self.run_capped(cap, _data(5, 16), retry_after=2)
        # k=2 works; after two steps at 2 the next tries 1, fails, goes back to 2
        self.assertEqual(step.last_k, 2)
        self.assertEqual(step.ooms, 3)

    def test_starting_k_from_a_prediction_skips_the_failures(self):
        cap = _Cap(rows=4)
        _, step, _ = self.run_capped(cap, _data(3, 16), k=4)
        self.assertEqual(cap.raised, 0)
        self.assertEqual(step.last_k, 4)

    def test_a_batch_of_one_that_does_not_fit_says_why(self):
        model, step, _ = None, None, None
        with self.assertRaises(CannotSplitError) as ctx:
            self.run_capped(_Cap(rows=0), _data(1, 2))
        text = str(ctx.exception)
        self.assertIn("cannot be split further", text)
        self.assertIn("CUDA out of memory", text)

    def test_max_k_bounds_the_split(self):
        with self.assertRaises(CannotSplitError) as ctx:
            self.run_capped(_Cap(rows=2), _data(1, 16), max_k=4)
        self.assertIn("max_k=4", str(ctx.exception))

    def test_other_errors_pass_through_untouched(self):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def loss_fn(batch):
            raise ValueError("a bug in the step")

        with self.assertRaisesRegex(ValueError, "a bug in the step"):
            MicroBatchStep(loss_fn, opt)(_data(1, 4)[0])

    def test_batches_that_cannot_be_split_are_refused_by_name(self):
        model = _model()
        step = MicroBatchStep(lambda b: model(b["x"]).sum(), torch.optim.SGD(model.parameters(), lr=0.1))
        with self.assertRaisesRegex(CannotSplitError, r"batch\['x'\] has 4 rows but batch\['mask'\] has 3"):
            step({"x": torch.randn(4, 12), "mask": torch.ones(3, 2)})
        with self.assertRaisesRegex(CannotSplitError, "no tensor with a batch dimension"):
            step({"x": 3})

    def test_mappings_and_outputs_with_a_loss(self):
        data = _data(2, 8)
        cap = _Cap(rows=4)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        class Out:
            def __init__(self, loss):
                self.loss = loss

        def loss_fn(batch):
            out = model(batch["input"])
            cap.check(batch["input"].shape[0])
            self.assertEqual(batch["note"], "kept")
            return Out(torch.nn.functional.cross_entropy(out, batch["labels"]))

        step = MicroBatchStep(loss_fn, opt)
        for x, y in data:
            step({"input": x, "labels": y, "note": "kept"})
        ref = _model()
        _reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, 2)
        self.assert_same_parameters(model, ref)

    def test_buffers_updated_by_a_failed_attempt_are_said(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.BatchNorm1d(8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cap = _Cap(rows=4)

        def loss_fn(batch):
            out = model(batch[0])
            cap.check(batch[0].shape[0])
            return out.pow(2).mean()

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            MicroBatchStep(loss_fn, opt, model=model)(_data(1, 8)[0])
        self.assertTrue(any("buffers" in str(w.message) for w in seen))

    def test_arguments_are_checked(self):
        opt = torch.optim.SGD(_model().parameters(), lr=0.1)
        with self.assertRaises(TypeError):
            MicroBatchStep(None, opt)
        with self.assertRaises(ValueError):
            MicroBatchStep(lambda b: b, opt, k=0)
        with self.assertRaises(TypeError):
            MicroBatchStep(lambda b: b, object())


def _ddp_worker(rank, world, path, rows, result_dir):
    import torch.distributed as dist

    os.environ["TORCH_DETERMINISTIC"] = "1"
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        cap = _Cap(rows=rows[rank])
        syncs = []

        def loss_fn(batch):
            x, y = batch
            syncs.append(model.require_backward_grad_sync)
            out = model(x)
            cap.check(x.shape[0])
            return torch.nn.functional.cross_entropy(out, y)

        step = MicroBatchStep(loss_fn, opt, model=model)
        for x, y in _data(3, 16, seed=10 + rank):
            step((x, y))
        torch.save(
            {"params": [p.detach() for p in model.module.parameters()], "k": step.last_k, "syncs": syncs},
            os.path.join(result_dir, "rank%d.pt" % rank),
        )
    finally:
        dist.destroy_process_group()


@unittest.skipIf(torch is None, "needs PyTorch (pip install torch: the CPU build will do)")
class MicroBatchDDPTest(unittest.TestCase):
    def test_ranks_agree_on_k_and_sync_only_the_last_micro_batch(self):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            self.skipTest("this PyTorch has no gloo backend")
        with tempfile.TemporaryDirectory() as d:
            # rank 0 fits 8 rows, rank 1 only 4: both must run 4 micro-batches.
            # (fresh interpreters running this file: the test runner may
            # read its main module from stdin, which spawn cannot import)
            env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
            procs = [
                subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ddp-worker", str(rank), d],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for rank in range(2)
            ]
            outs = [p.communicate(timeout=300)[0] for p in procs]
            for p, out in zip(procs, outs):
                self.assertEqual(p.returncode, 0, out[-3000:])
            r0 = torch.load(os.path.join(d, "rank0.pt"))
            r1 = torch.load(os.path.join(d, "rank1.pt"))
        self.assertEqual((r0["k"], r1["k"]), (4, 4))
        for p, q in zip(r0["params"], r1["params"]):
            self.assertTrue(torch.equal(p, q))
        # the first step at k=4 exchanges gradients itself (all four under
        # no_sync); the next ones as DDP does: three without sync, one with
        self.assertEqual(r0["syncs"][-8:], [False, False, False, True] * 2)
        self.assertIn([False] * 4, [r0["syncs"][i:i + 4] for i in range(len(r0["syncs"]) - 8)])
        # against one process averaging the two ranks' accumulated gradients
        ref = _model()
        opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for (x0, y0), (x1, y1) in zip(_data(3, 16, seed=10), _data(3, 16, seed=11)):
            grads = []
            for x, y in ((x0, y0), (x1, y1)):
                opt.zero_grad(set_to_none=True)
                for xs, ys in zip(x.split(4), y.split(4)):
                    (torch.nn.functional.cross_entropy(ref(xs), ys) * 0.25).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            for p, g0, g1 in zip(ref.parameters(), *grads):
                p.grad = (g0 + g1) / 2
            opt.step()
        for p, q in zip(ref.parameters(), r0["params"]):
            torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ddp-worker":
        rank, d = int(sys.argv[2]), sys.argv[3]
        _ddp_worker(rank, 2, os.path.join(d, "store"), (8, 4), d)
    else:
        unittest.main()
