#!/usr/bin/env python3
"""Out of memory the way the ecosystem expects it: batch-size finders and
the micro-batch helper, under native PyTorch and under gpumem, on one GPU.

    python3 bench/torch/oom_finders.py all [--cap-gib 12] [--out DIR]
    python3 bench/torch/oom_finders.py run FINDER --allocator native|gpumem [--cap-gib 12]
    python3 bench/torch/oom_finders.py microbatch --allocator native|gpumem [--cap-gib 12]

The job: a small Llama-style model (transformers, built from a config, fp32,
AdamW) trained on random tokens, under a per-process memory fraction
(torch.cuda.set_per_process_memory_fraction(cap / total)). Each finder runs
in a fresh process, started as a user would: `python3 script` for native
PyTorch, `python3 -m gpumem.torch script` for gpumem. Finders:

  halving      a plain `except torch.OutOfMemoryError:` loop halving from 64
  accelerate   accelerate.utils.find_executable_batch_size from 64
  trainer      transformers Trainer(auto_find_batch_size=True) from 64
  power        lightning Tuner.scale_batch_size(mode="power")
  binsearch    lightning Tuner.scale_batch_size(mode="binsearch")

Each then trains 20 optimizer steps at the batch it found (the Trainer and
Lightning with their own fit). `all` prints one table: the batch found
under each allocator and whether the 20 steps ran.

`microbatch`: a batch that does not fit under the cap, trained with
gpumem.torch.microbatch for a few steps; the same micro-batches accumulated
by a plain loop with the cap lifted; parameters compared bit for bit (fp32,
deterministic algorithms) and under bf16 autocast; and the helper's step
time against the plain loop's and against k plain steps at the micro-batch
size, in turns in the same process.

--device cpu --fake-rows N runs the same code on the CPU with a stand-in
cap (a forward pre-hook raising PyTorch's out-of-memory error above N rows):
a check of the harness only, not a measurement.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FINDERS = ("halving", "accelerate", "trainer", "power", "binsearch")
SEQ = 512
VOCAB = 32000
FIT_STEPS = 20


def emit(**result):
    print(json.dumps(result), flush=True)


# ---- the job ---------------------------------------------------------------


def make_model(torch, device, seed=0, layers=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=SEQ,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager" if device == "cpu" else "sdpa"
    model = LlamaForCausalLM(cfg).to(device)
    model.config.use_cache = False
    return model


def tokens(torch, batch, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g).to(device)


def fake_cap(torch, model, rows):
    """The CPU stand-in: PyTorch's out-of-memory error above `rows` rows."""

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] > rows:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
                "1.00 GiB of which 0 bytes is free. (stand-in cap of %d rows)" % rows
            )

    model.register_forward_pre_hook(hook, with_kwargs=True)


def setup(args):
    import torch

    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    return torch


def train_steps(torch, model, opt, batch, steps, device, seed=0):
    for i in range(steps):
        ids = tokens(torch, batch, device, seed + i)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def prepared(args):
    torch = setup(args)
    model = make_model(torch, args.device, layers=args.layers)
    if args.fake_rows:
        fake_cap(torch, model, args.fake_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return torch, model, opt


# ---- finders -----------------------------------------------------------------


def finder_halving(args):
    torch, model, opt = prepared(args)
    batch = 64
    while True:
        failed = False
        try:
            train_steps(torch, model, opt, batch, 2, args.device)
        except torch.OutOfMemoryError:
            failed = True
        if not failed:
            break
        opt.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        batch //= 2
        if batch == 0:
            return {"found": 0}
    train_steps(torch, model, opt, batch, FIT_STEPS, args.device, seed=100)
    return {"found": batch, "fit_steps": FIT_STEPS}


def finder_accelerate(args):
    from accelerate.utils import find_executable_batch_size

    torch, model, opt = prepared(args)

    @find_executable_batch_size(starting_batch_size=64)
    def probe(batch_size):
        opt.zero_grad(set_to_none=True)
        train_steps(torch, model, opt, batch_size, 2, args.device)
        return batch_size

    batch = probe()
    train_steps(torch, model, opt, batch, FIT_STEPS, args.device, seed=100)
    return {"found": batch, "fit_steps": FIT_STEPS}


class TokenData:
    def __init__(self, n, kind="dict"):
        self.n, self.kind = n, kind

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        return {"input_ids": ids, "labels": ids} if self.kind == "dict" else ids


def finder_trainer(args):
    from transformers import Trainer, TrainingArguments

    torch = setup(args)
    model = make_model(torch, args.device, layers=args.layers)
    if args.fake_rows:
        fake_cap(torch, model, args.fake_rows)
    with tempfile.TemporaryDirectory() as d:
        targs = TrainingArguments(
            output_dir=d,
            per_device_train_batch_size=64,
            auto_find_batch_size=True,
            max_steps=FIT_STEPS,
            learning_rate=1e-5,
            logging_strategy="no",
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            use_cpu=args.device == "cpu",
        )
        trainer = Trainer(model=model, args=targs, train_dataset=TokenData(64 * (FIT_STEPS + 2)))
        out = trainer.train()
        return {"found": int(trainer._train_batch_size), "fit_steps": int(out.global_step)}


def finder_lightning(args, mode):
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    torch = setup(args)
    device = args.device

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2
            self.model = make_model(torch, "cpu", layers=args.layers)
            if args.fake_rows:
                fake_cap(torch, self.model, args.fake_rows)

        def training_step(self, batch, idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(TokenData(4096, kind="ids"), batch_size=self.batch_size)

    lm = LM()
    with tempfile.TemporaryDirectory() as d:
        trainer = pl.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu",
            devices=1,
            max_steps=FIT_STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=d,
        )
        found = Tuner(trainer).scale_batch_size(lm, mode=mode, init_val=2, max_trials=10, steps_per_trial=3)
        trainer.fit(lm)
        return {"found": int(found), "fit_steps": int(trainer.global_step)}


def run_finder(args):
    fn = {
        "halving": finder_halving,
        "accelerate": finder_accelerate,
        "trainer": finder_trainer,
        "power": lambda a: finder_lightning(a, "power"),
        "binsearch": lambda a: finder_lightning(a, "binsearch"),
    }[args.finder]
    t0 = time.time()
    try:
        result = fn(args)
    except Exception as e:  # the crash is the finding
        emit(finder=args.finder, allocator=args.allocator, error="%s: %s" % (type(e).__name__, str(e)[:600]))
        return 1
    import torch

    stats = torch.cuda.memory_stats() if args.device == "cuda" else {}
    emit(
        finder=args.finder,
        allocator=args.allocator,
        seconds=round(time.time() - t0, 1),
        num_ooms=stats.get("num_ooms"),
        max_reserved=torch.cuda.max_memory_reserved() if args.device == "cuda" else None,
        **result,
    )
    return 0


# ---- the micro-batch helper ------------------------------------------------------


def run_microbatch(args):
    torch = setup(args)
    sys.path.insert(0, os.path.join(REPO, "python"))
    import gpumem.torch as gt

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    device, steps, batch = args.device, args.steps, args.batch

    def data(step):
        return tokens(torch, batch, device, seed=1000 + step)

    def helper_run(autocast, k=1, retry_after=0):
        model = make_model(torch, device, layers=args.layers)
        if args.fake_rows:
            fake_cap(torch, model, args.fake_rows)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def loss_fn(ids):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                return model(input_ids=ids, labels=ids).loss

        step = gt.microbatch(loss_fn, opt, model=model, k=k, retry_after=retry_after)
        for i in range(steps):
            step(data(i))
        return model, opt, step

    def plain_run(autocast, k):
        model = make_model(torch, device, layers=args.layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for i in range(steps):
            plain_step(model, opt, data(i), k, autocast)
        return model

    def plain_step(model, opt, ids, k, autocast):
        n = ids.shape[0]
        sizes = [n // k + (1 if j < n % k else 0) for j in range(k)]
        opt.zero_grad(set_to_none=True)
        for part, m in zip(ids.split(sizes), sizes):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=part, labels=part).loss
            (loss * (m / n)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def compare(a, b):
        same, worst = True, 0.0
        for p, q in zip(a.parameters(), b.parameters()):
            if not torch.equal(p, q):
                same = False
                worst = max(worst, (p.float() - q.float()).abs().max().item())
        return same, worst

    result = {"batch": batch, "steps": steps, "cap_gib": args.cap_gib}
    for autocast in (False, True):
        tag = "bf16" if autocast else "fp32"
        capped, _, st = helper_run(autocast)
        result[tag + "_k"] = st.last_k
        result[tag + "_ooms"] = st.ooms
        if device == "cuda":
            result[tag + "_capped_max_reserved"] = torch.cuda.max_memory_reserved()
            torch.cuda.set_per_process_memory_fraction(1.0)  # the reference runs uncapped
        ref = plain_run(autocast, st.last_k)
        same, worst = compare(capped, ref)
        result[tag + "_bitwise_equal"] = same
        result[tag + "_max_abs_diff"] = worst
        del capped, ref
        if device == "cuda":
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
            torch.cuda.reset_peak_memory_stats()

    # Step time, uncapped, in turns: the helper at k against the plain
    # accumulating loop at k and against one plain step at the micro-batch size.
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0)
    k = result["fp32_k"]
    model = make_model(torch, device, layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = gt.microbatch(lambda ids: model(input_ids=ids, labels=ids).loss, opt, model=model, k=k, retry_after=0)
    ids = data(0)
    micro = ids[: (batch + k - 1) // k]

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(2):  # warm-up
        step(ids)
        plain_step(model, opt, ids, k, False)
        plain_step(model, opt, micro, 1, False)
    helper_t, loop_t, micro_t = [], [], []
    for _ in range(args.pairs):
        helper_t.append(timed(lambda: step(ids)))
        loop_t.append(timed(lambda: plain_step(model, opt, ids, k, False)))
        micro_t.append(timed(lambda: plain_step(model, opt, micro, 1, False)))

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    result.update(
        helper_step_ms=round(1e3 * median(helper_t), 2),
        loop_step_ms=round(1e3 * median(loop_t), 2),
        micro_step_ms=round(1e3 * median(micro_t), 2),
        helper_over_loop=round(median([h / lp for h, lp in zip(helper_t, loop_t)]), 4),
        helper_over_k_micro=round(median([h / (k * m) for h, m in zip(helper_t, micro_t)]), 4),
        pairs=args.pairs,
    )
    emit(allocator=args.allocator, **result)
    return 0


# ---- all of them ---------------------------------------------------------------------


def child(argv, allocator):
    script = os.path.abspath(__file__)
    if allocator == "gpumem":
        cmd = [sys.executable, "-m", "gpumem.torch", script] + argv + ["--allocator", "gpumem"]
    else:
        cmd = [sys.executable, script] + argv + ["--allocator", "native"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"allocator": allocator, "error": "exit %d: %s" % (proc.returncode, proc.stderr[-1500:])}
    return json.loads(lines[-1])


def run_all(args):
    common = ["--cap-gib", str(args.cap_gib), "--device", args.device, "--layers", str(args.layers)]
    if args.fake_rows:
        common += ["--fake-rows", str(args.fake_rows)]
    out = open(os.path.join(args.out, "oom_finders.jsonl"), "a") if args.out else None
    # Each process holds at most its cap: with --jobs N, N of them share
    # the GPU at once (the batch found depends on the cap, not on time).
    from concurrent.futures import ThreadPoolExecutor

    finders = args.finders.split(",")
    work = [(f, a) for f in finders for a in ("native", "gpumem")]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda fa: child(["run", fa[0]] + common, fa[1]), work))
    rows = [(f, {}) for f in finders]
    for (finder, allocator), r in zip(work, results):
        r.update(finder=finder, allocator=allocator)
        rows[finders.index(finder)][1][allocator] = r
        print(json.dumps(r), file=sys.stderr, flush=True)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()
    print("%-11s %-28s %-28s %s" % ("finder", "native: found, steps", "gpumem: found, steps", "verdict"))
    bad = 0
    for finder, pair in rows:
        cells = []
        for allocator in ("native", "gpumem"):
            r = pair[allocator]
            cells.append("error: " + r["error"][:20] if "error" in r else "%d, %d steps" % (r["found"], r.get("fit_steps", 0)))
        n, g = pair["native"], pair["gpumem"]
        ok = "error" not in g and g.get("fit_steps", 0) >= FIT_STEPS and ("error" in n or g["found"] >= n["found"])
        bad += not ok
        print("%-11s %-28s %-28s %s" % (finder, cells[0], cells[1], "ok" if ok else "MISS"))
    if args.microbatch:
        for allocator in ("gpumem", "native"):
            mb = child(["microbatch"] + common + ["--batch", str(args.batch)], allocator)
            print(json.dumps(mb), flush=True)
            if out:
                out.write(json.dumps(mb) + "\n")
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["all", "run", "microbatch"])
    p.add_argument("finder", nargs="?", choices=FINDERS)
    p.add_argument("--allocator", choices=["native", "gpumem"], default="native")
    p.add_argument("--cap-gib", type=float, default=12.0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--fake-rows", type=int, default=0)
    p.add_argument("--finders", default=",".join(FINDERS))
    p.add_argument("--out", default=None)
    p.add_argument("--jobs", type=int, default=1, help="all: finder processes at a time")
    p.add_argument("--microbatch", action="store_true", help="all: the micro-batch check too")
    p.add_argument("--batch", type=int, default=48, help="microbatch: the batch that does not fit")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--pairs", type=int, default=10)
    args = p.parse_args()
    if args.device == "cpu" and not args.fake_rows and args.what != "microbatch":
        p.error("--device cpu needs --fake-rows N (there is no memory cap to hit on the CPU)")
    if args.what == "run":
        if not args.finder:
            p.error("run needs a FINDER: " + ", ".join(FINDERS))
        return run_finder(args)
    if args.what == "microbatch":
        return run_microbatch(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
