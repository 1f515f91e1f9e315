"""Training and inference jobs as users write them, for the accuracy of
gpumem's prediction (bench/torch/predict_accuracy.py): models built from
configurations with random weights, a few steps at one batch size.

    python3 bench/torch/predict_jobs.py JOB --batch-size B [--steps N] [--seq-len L]
            [--allocator native|expandable|gpumem] [--fraction F] [--json FILE]
    python3 bench/torch/predict_jobs.py JOB --batch-size B --memtracker [--json FILE]

Training jobs take AdamW steps under bf16 autocast; inference jobs run
generate() on a bf16 model (one generate() a step, greedy, a fixed number of new
tokens). The script is an ordinary training script: `python -m
gpumem.predict ... bench/torch/predict_jobs.py JOB --batch-size {B}` runs
it at small batch sizes, on the GPU or on fake CUDA tensors.

--allocator picks the allocator of this process (expandable: PyTorch's
with expandable_segments:True; gpumem: gpumem.torch.enable()), --fraction
caps it with torch.cuda.set_per_process_memory_fraction. --json writes the
steps done, peak reserved and allocated bytes and whether the job ran out
of memory (a run out of memory exits 0 with "oom": true).

--memtracker estimates the job's peak instead with PyTorch's
torch.distributed._tools.mem_tracker.MemTracker, as its documentation
shows it: the model, optimizer and inputs built under FakeTensorMode on
the CUDA device (the model built there in its dtype rather than moved:
see on_gpu), tracked, steps run inside the tracker; --json gets its peak
("Total" of the peak snapshot) or the error it raised.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

SEQ = 256  # tokens per sequence of the language-model training jobs
PROMPT, NEW_TOKENS = 128, 32  # generate() jobs
IMAGE = 224


MEMTRACKER = False  # --memtracker: models built in place (see on_gpu)


def set_seq_len(n):
    """--seq-len: the tokens per sequence of the language-model training jobs."""
    global SEQ
    SEQ = n


def on_gpu(build, dtype=None):
    """build() moved to the GPU (and cast to dtype), as scripts do. For
    MemTracker the model is built where it will live instead (under
    FakeTensorMode and torch.device("cuda"), in dtype as the default):
    moving or casting fake parameters raises "Couldn't swap", so this
    gives MemTracker its best chance."""
    import torch

    if not MEMTRACKER:
        return build().to("cuda", dtype) if dtype else build().cuda()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype or old)
    try:
        return build()
    finally:
        torch.set_default_dtype(old)


def llama_config(hidden, intermediate, layers, heads, kv_heads, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=2048, pad_token_id=0, **extra)  # fmt: skip


def lm_train(model, vocab, batch, length=None):
    """A causal LM's training step on random tokens (labels = inputs)."""
    import torch

    length = length or SEQ

    def step(opt):
        ids = torch.randint(1, vocab, (batch, length), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def gpt2(batch, ckpt=False):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=6, use_cache=False)
    model = on_gpu(lambda: GPT2LMHeadModel(cfg))
    if ckpt:
        model.gradient_checkpointing_enable()
    return model, lm_train(model, cfg.vocab_size, batch)


def llama(batch, ckpt=False):
    from transformers import LlamaForCausalLM

    cfg = llama_config(1024, 2816, 8, 16, 8, use_cache=False)
    model = on_gpu(lambda: LlamaForCausalLM(cfg))
    if ckpt:
        model.gradient_checkpointing_enable()
    return model, lm_train(model, cfg.vocab_size, batch)


def llama_lora(batch):
    """PEFT LoRA (r 16 on the attention and MLP projections) over a frozen
    bf16 base."""
    import peft
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(2048, 5632, 8, 16, 4, use_cache=False)
    base = on_gpu(lambda: LlamaForCausalLM(cfg), torch.bfloat16)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, lora)
    return model, lm_train(model, cfg.vocab_size, batch)


def bert(batch):
    """BERT masked-LM training (every token a label) at length 256."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=6)
    model = on_gpu(lambda: BertForMaskedLM(cfg))

    def step(opt):
        ids = torch.randint(1, cfg.vocab_size, (batch, SEQ), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def t5(batch):
    """T5 (6+6 layers, d_model 512) sequence to sequence: 256 in, 64 out."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, decoder_start_token_id=0)
    model = on_gpu(lambda: T5ForConditionalGeneration(cfg))

    def step(opt):
        src = torch.randint(1, cfg.vocab_size, (batch, SEQ), device="cuda")
        tgt = torch.randint(1, cfg.vocab_size, (batch, 64), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=src, labels=tgt).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def timm_train(name, batch, ckpt=False):
    """A timm image model by name, 224 x 224, channels-last, cross-entropy."""
    import timm
    import torch

    model = on_gpu(lambda: timm.create_model(name, pretrained=False, num_classes=1000))
    if ckpt:
        model.set_grad_checkpointing(True)
    if not MEMTRACKER:
        model = model.to(memory_format=torch.channels_last)
    lossf = torch.nn.CrossEntropyLoss()

    def step(opt):
        x = torch.randn(batch, 3, IMAGE, IMAGE, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def bert_scaler(batch):
    """BERT sequence classification (6 layers, length 256) in float16
    autocast with a GradScaler, as mixed-precision scripts of the fp16 era
    are written."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_hidden_layers=6, num_labels=4)
    model = on_gpu(lambda: BertForSequenceClassification(cfg))
    scaler = torch.amp.GradScaler("cuda")

    def step(opt):
        ids = torch.randint(1, cfg.vocab_size, (batch, SEQ), device="cuda")
        labels = torch.randint(0, 4, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return model, step


def resnet_sgd(batch):
    """timm ResNet-18 trained by a hand-written SGD update (no optimizer
    object: p -= lr * p.grad under no_grad), as tutorials write it."""
    import timm
    import torch

    model = on_gpu(lambda: timm.create_model("resnet18", pretrained=False, num_classes=1000))
    model.train()
    lossf = torch.nn.CrossEntropyLoss()

    def step(opt):
        x = torch.randn(batch, 3, IMAGE, IMAGE, device="cuda")
        y = torch.randint(0, 1000, (batch,), device="cuda")
        loss = lossf(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None

    return model, step


def generate_job(model, vocab, batch):
    """generate() on random prompts: greedy, NEW_TOKENS new tokens each."""
    import torch

    model.eval()

    def step(opt):
        ids = torch.randint(1, vocab, (batch, PROMPT), device="cuda")
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, use_cache=True)

    return model, step


def gpt2_generate(batch):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(pad_token_id=0)  # GPT-2 small, 124M
    model = on_gpu(lambda: GPT2LMHeadModel(cfg), torch.bfloat16)
    return generate_job(model, cfg.vocab_size, batch)


def llama_generate(batch):
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(2048, 5632, 12, 16, 4)
    model = on_gpu(lambda: LlamaForCausalLM(cfg), torch.bfloat16)
    return generate_job(model, cfg.vocab_size, batch)


def greedy_decode(family, hidden, layers, heads, prompt, new_tokens):
    """A decoder loaded in bf16, then greedy generate() with HF's dynamic KV
    cache: a prefill, then each new token concatenated onto every layer's
    cache, each step a slightly larger block per layer, the previous freed."""

    def make(batch):
        import torch

        if family == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, pad_token_id=0)
            model = on_gpu(lambda: GPT2LMHeadModel(cfg), torch.bfloat16)
        else:
            from transformers import LlamaForCausalLM

            cfg = llama_config(hidden, hidden * 11 // 4, layers, heads, max(1, heads // 4))
            model = on_gpu(lambda: LlamaForCausalLM(cfg), torch.bfloat16)
        model.eval()

        def step(opt):
            ids = torch.randint(1, cfg.vocab_size, (batch, prompt), device="cuda")
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True)

        return model, step

    return make


# name -> (build(batch) -> (model, step(opt)), training?)
JOBS = {
    "gpt2": (lambda b: gpt2(b), True),
    "gpt2_ckpt": (lambda b: gpt2(b, ckpt=True), True),
    "llama": (lambda b: llama(b), True),
    "llama_ckpt": (lambda b: llama(b, ckpt=True), True),
    "llama_lora": (llama_lora, True),
    "bert": (bert, True),
    "t5": (t5, True),
    "resnet50": (lambda b: timm_train("resnet50", b), True),
    "vit": (lambda b: timm_train("vit_base_patch16_224", b), True),
    "vit_ckpt": (lambda b: timm_train("vit_base_patch16_224", b, ckpt=True), True),
    "convnext": (lambda b: timm_train("convnext_tiny", b), True),
    "bert_scaler": (bert_scaler, True),
    "resnet_sgd": (resnet_sgd, False),
    "gpt2_generate": (gpt2_generate, False),
    "llama_generate": (llama_generate, False),
    # greedy decoding at three sizes (traces/jobs/README.md): --batch-size is the requests' batch
    "decode_gpt2": (greedy_decode("gpt2", 768, 12, 12, prompt=64, new_tokens=512), False),
    "decode_gpt2_medium": (greedy_decode("gpt2", 1024, 24, 16, prompt=128, new_tokens=256), False),
    "decode_gpt2_large": (greedy_decode("gpt2", 1280, 36, 20, prompt=96, new_tokens=320), False),
    "decode_gpt2_long": (greedy_decode("gpt2", 768, 12, 12, prompt=64, new_tokens=960), False),
    "decode_llama": (greedy_decode("llama", 1536, 16, 16, prompt=256, new_tokens=192), False),
}


def is_oom(torch, exc):
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    gt = sys.modules.get("gpumem.torch")
    return gt is not None and gt.is_oom(exc)


def build(torch, job, batch):
    make, training = JOBS[job]
    model, step = make(batch)
    if training:
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    else:
        opt = None
    return model, step, opt


def run(torch, args):
    result = {"job": args.job, "batch": args.batch_size, "allocator": args.allocator, "fraction": args.fraction,
              "steps": 0, "oom": False}  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.init()
        if args.fraction is not None:
            torch.cuda.set_per_process_memory_fraction(args.fraction)
    if args.snapshot:
        # as PyTorch's memory tutorial records, with Python frames only
        # (C++ frames take minutes to symbolize at the dump)
        torch.cuda.memory._record_memory_history(max_entries=10_000_000, stacks="python")
    t0 = time.perf_counter()
    try:
        model, step, opt = build(torch, args.job, args.batch_size)
        for _ in range(args.steps):
            step(opt)
            result["steps"] += 1
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (only running out of memory is an answer)
        if not is_oom(torch, e):
            raise
        result["oom"] = True
        result["oom_message"] = str(e).splitlines()[0][:300]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.snapshot:
        write_snapshot(torch, args.snapshot)
    result["peak_reserved"] = torch.cuda.max_memory_reserved()
    result["peak_allocated"] = torch.cuda.max_memory_allocated()
    result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    return result


def write_snapshot(torch, path):
    """PyTorch's snapshot as _dump_snapshot writes it, gzipped, each frame
    and frame list made one shared object (pickle's memo then stores it
    once: a recording of a few steps is megabytes, not hundreds), the
    blocks of segments without their frames (the readers use the events)."""
    import gzip
    import pickle

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    frames, lists = {}, {}

    def shared(fs):
        key = tuple((f.get("filename"), f.get("line"), f.get("name")) for f in fs)
        if key not in lists:
            lists[key] = [frames.setdefault(k, {"filename": k[0], "line": k[1], "name": k[2]}) for k in key]
        return lists[key]

    for trace in snap.get("device_traces", []):
        for e in trace:
            e["frames"] = shared(e.get("frames") or [])
    for seg in snap.get("segments", []):
        seg.pop("frames", None)
        for blk in seg.get("blocks", []):
            blk.pop("frames", None)
    with gzip.open(path, "wb", compresslevel=6) as f:
        pickle.dump(snap, f, protocol=4)


def memtracker(torch, args):
    """MemTracker's estimate of the job at --batch-size, or the error it raised."""
    result = {"job": args.job, "batch": args.batch_size, "tool": "MemTracker", "torch": torch.__version__}
    t0 = time.perf_counter()
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker

        with FakeTensorMode(), torch.device("cuda"):
            model, step, opt = build(torch, args.job, args.batch_size)
            mt = MemTracker()
            mt.track_external(*([model] + ([opt] if opt is not None else [])))
            with mt:
                for k in range(args.steps):
                    step(opt)
                    if k + 1 < args.steps:
                        mt.reset_mod_stats()  # as its tests do between iterations
            peak = mt.get_tracker_snapshot("peak")
        result["peak_bytes"] = max(int(v.get("Total", 0)) for v in peak.values())
    except Exception as e:  # noqa: BLE001 (the error is the answer)
        result["error"] = "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0][:300] if str(e).strip() else "")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", choices=sorted(JOBS))
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=SEQ,
                    help="tokens per sequence of the language-model training jobs (default %d)" % SEQ)
    ap.add_argument("--allocator", choices=["native", "expandable", "gpumem"], default="native")
    ap.add_argument("--fraction", type=float, default=None)
    ap.add_argument("--memtracker", action="store_true")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--snapshot", default=None,
                    help="record PyTorch's allocation history from the start and write the snapshot here (gzipped)")
    args = ap.parse_args()
    if args.batch_size < 1 or args.steps < 1 or args.seq_len < 1:
        ap.error("--batch-size, --steps and --seq-len must be at least 1")
    set_seq_len(args.seq_len)
    if args.allocator == "expandable":
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(x for x in (conf, "expandable_segments:True") if x)
    elif args.allocator == "gpumem":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import gpumem.torch

        gpumem.torch.enable()
    import torch

    torch.manual_seed(0)
    global MEMTRACKER
    MEMTRACKER = args.memtracker
    result = memtracker(torch, args) if args.memtracker else run(torch, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
