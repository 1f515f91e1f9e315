"""The four workloads of traces/README.md as the project's own programs, and
jobs as users write them, run under one allocator per process.

    python3 bench/torch/workloads.py WORKLOAD --allocator native|expandable|async|gpumem
            [--steps N] [--warmup W] [--fraction F | --limit BYTES] [--conf C] [--bisect PROBES]

WORKLOAD is one of the bundled four (gpt2_train, resnet50_train,
llama_ckpt_train, t5_varlen_prefetch) or a user-style job:
llama_finetune_varlen (a ~0.6B Llama fine-tuned on padded batches whose
batch size 4-8 and length 256-2048 change every micro-step, gradient
accumulation 2, AdamW, bf16 autocast; llama_finetune_varlen_half the same
at batch 2-4), llama_generate_serve (generate()
requests of batch 1-16 and prompt length 32-1024 on a ~0.4B Llama in bf16)
or convnext_timm (timm's ConvNeXt-Base, fixed shapes). Models are built
from configurations with random weights; shapes are drawn from seeds, so
every process sees the same shapes at the same step. Prints one JSON line: the median step time (ms, the
GPU synchronized around each step, after the warm-up steps), peak reserved
and peak allocated bytes (torch.cuda.max_memory_reserved/allocated, which
report gpumem's figures when gpumem is the allocator) and whether the run
ran out of memory.

Host-bound steps (t5 leaves the GPU idle ~90% of a step on the H200 host of
2026-11-26) pick up the host's noise, Python's garbage collector included:
each timed step's collector time is reported (`gc_ms`), and --gc freeze
collects once and freezes every object made so far (gc.freeze) before the
timed steps, so the collector no longer walks the model's objects in them.

--fraction caps the process at F of the device's memory
(torch.cuda.set_per_process_memory_fraction) for the whole run; --limit
caps it at BYTES (gpumem's limit: key under gpumem, the same fraction call
otherwise).
--bisect P, after the timed run, looks for the smallest fraction under which
the workload still trains (the same steps again, same batch shapes) with P probes between peak
allocated (cannot fit below) and peak reserved (fits), in this same process:
between probes the optimizer state, gradients and activations are dropped
and the cache emptied, so each probe starts from the weights alone, as a
fresh process would after building its model.

Allocators: native is PyTorch's caching allocator; expandable the same with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; async is PyTorch's
cudaMallocAsync backend (backend:cudaMallocAsync); gpumem installs gpumem
through gpumem.torch.enable (GPUMEM_CONF or --conf configures it).
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def gpumem_conf(args):
    """The gpumem configuration of this run: --conf (else GPUMEM_CONF) with
    --limit added as gpumem's own cap."""
    conf = args.conf if args.conf is not None else os.environ.get("GPUMEM_CONF", "")
    if args.limit is not None:
        conf = ",".join(x for x in (conf, "limit:%d" % args.limit) if x)
    return conf or None


def install_allocator(args):
    """Before torch touches CUDA."""
    torch_conf = {"expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}
    if args.allocator in torch_conf:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(x for x in (conf, torch_conf[args.allocator]) if x)
    elif args.allocator == "gpumem":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import gpumem.torch

        gpumem.torch.enable(gpumem_conf(args))
    import torch

    return torch


def is_oom(torch, exc):
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    gt = sys.modules.get("gpumem.torch")
    return gt is not None and gt.is_oom(exc)


# ---- the workloads: build() returns (state, step); step(state, i) trains once


def optimizer_step(state, loss):
    """The end of a training step: backward, the optimizer's step, the
    gradients dropped (set_to_none, as PyTorch does by default)."""
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad(set_to_none=True)
    return loss



def gpt2_train(torch, args):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config()  # GPT-2 small, 124M
    with torch.device("cuda"):
        model = GPT2LMHeadModel(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make_state():
        return {"opt": torch.optim.AdamW(model.parameters(), lr=1e-4)}

    def step(state, i):
        ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        return optimizer_step(state, loss)

    return model, make_state, step


def resnet50_train(torch, args):
    import torchvision

    with torch.device("cuda"):
        model = torchvision.models.resnet50(weights=None)
    model = model.to(memory_format=torch.channels_last)
    lossf = torch.nn.CrossEntropyLoss()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make_state():
        return {"opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}

    def step(state, i):
        x = torch.randn(128, 3, 224, 224, device="cuda", generator=gen).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (128,), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lossf(model(x), y)
        return optimizer_step(state, loss)

    return model, make_state, step


def llama_config(hidden, intermediate, layers, heads, kv_heads, **extra):
    """A Llama-style decoder's configuration (HF transformers, vocabulary
    32,000, positions up to 2,048): what the Llama workloads differ in."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=2048, **extra)


def llama_ckpt_train(torch, args):
    from transformers import LlamaForCausalLM

    cfg = llama_config(2048, 5504, 8, 16, 16, use_cache=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable()
    model.train()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make_state():
        return {"opt": torch.optim.AdamW(model.parameters(), lr=1e-4)}

    def step(state, i):
        ids = torch.randint(0, cfg.vocab_size, (4, 2048), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        return optimizer_step(state, loss)

    return model, make_state, step


def t5_varlen_prefetch(torch, args):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=32128,
        d_model=768,
        d_kv=64,
        d_ff=3072,
        num_layers=6,
        num_decoder_layers=6,
        num_heads=12,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,  # T5's convention; labels are shifted right from it
    )
    with torch.device("cuda"):
        model = T5ForConditionalGeneration(cfg)
    model.train()
    # Batches vary in size and both lengths every step; they are made on the
    # host (pinned) and the next one is copied on a side stream while the
    # current one trains, then handed to the compute stream with
    # record_stream: the two-stream pattern of a real input pipeline.
    import random

    rnd = random.Random(0)
    total = args.warmup + args.steps + 2
    host = []
    for _ in range(total):
        b, s, t = rnd.choice((8, 16, 24, 32)), rnd.randrange(64, 513, 64), rnd.randrange(16, 257, 16)
        host.append(
            {
                "input_ids": torch.randint(0, cfg.vocab_size, (b, s)).pin_memory(),
                "attention_mask": torch.ones(b, s, dtype=torch.long).pin_memory(),
                "labels": torch.randint(0, cfg.vocab_size, (b, t)).pin_memory(),
            }
        )
    side = torch.cuda.Stream()

    def stage(i):
        with torch.cuda.stream(side):
            return {k: v.to("cuda", non_blocking=True) for k, v in host[i % len(host)].items()}

    def make_state():
        return {"opt": torch.optim.AdamW(model.parameters(), lr=1e-4), "next": None}

    def step(state, i):
        main = torch.cuda.current_stream()
        batch = state["next"] if state["next"] is not None else stage(i)
        main.wait_stream(side)
        for v in batch.values():
            v.record_stream(main)
        state["next"] = stage(i + 1)  # overlaps with this step's compute
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        del batch
        return optimizer_step(state, loss)

    return model, make_state, step


# ---- jobs as users write them: shapes drawn per step, gradient accumulation,
# generate(). Shapes come from random.Random seeded with the step index, so
# every process (and every probe of --bisect) sees the same shapes at step i.

FINETUNE_ACCUMULATION = 2


def finetune_varlen(batch_range):
    """A ~0.6B Llama-style decoder fine-tuned on padded batches: per
    micro-step, a batch size drawn from batch_range (4-8 for
    llama_finetune_varlen; 2-4 for llama_finetune_varlen_half, whose two
    processes fit one 80 GB card together in lockstep, where the full job's
    need about 80 GB) and padded length 256-2048 (uniform), each row's real
    length between half the padded length and all of it (right padding,
    attention mask, labels -100 on padding); gradient accumulation 2,
    AdamW, bf16 autocast. One step = one optimizer step."""
    lo, hi = batch_range
    return lambda torch, args: finetune_varlen_job(torch, lo, hi)


def finetune_varlen_job(torch, batch_lo, batch_hi):
    import random

    from transformers import LlamaForCausalLM

    cfg = llama_config(1536, 4096, 18, 12, 12, pad_token_id=0, use_cache=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.train()

    def micro_batch(i, k):
        rnd = random.Random(1_000_003 * i + k)
        b, s = rnd.randint(batch_lo, batch_hi), rnd.randint(256, 2048)
        lengths = [rnd.randint(s // 2, s) for _ in range(b)]
        gen = torch.Generator().manual_seed(1_000_003 * i + k)
        ids = torch.randint(1, cfg.vocab_size, (b, s), generator=gen)
        mask = torch.zeros(b, s, dtype=torch.long)
        for r, n in enumerate(lengths):
            mask[r, :n] = 1
        ids = ids * mask  # pad token 0 after each row's end
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids.to("cuda"), "attention_mask": mask.to("cuda"), "labels": labels.to("cuda")}

    def make_state():
        return {"opt": torch.optim.AdamW(model.parameters(), lr=1e-5)}

    def step(state, i):
        total = None
        for k in range(FINETUNE_ACCUMULATION):
            batch = micro_batch(i, k)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / FINETUNE_ACCUMULATION
            del batch
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
            del loss
        state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)
        return total

    return model, make_state, step


def llama_generate_serve(torch, args):
    """generate() serving with a ~0.4B Llama-style decoder in bf16: per
    request, batch 1-16 and padded prompt length 32-1024 (uniform), each
    prompt between half and all of it (left padding, attention mask),
    greedy, 32 new tokens (min_new_tokens too, so every process generates
    the same number whatever the random weights pick). One step = one
    generate() call; the cache grows token by token (DynamicCache)."""
    import random

    import transformers
    from transformers import LlamaForCausalLM

    cfg = llama_config(1536, 4096, 12, 12, 4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    # built on the host and moved as bf16: no fp32 copy ever on the GPU,
    # where its freed pages would stay in the peak of every allocator
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.eval()
    transformers.logging.set_verbosity_error()  # no per-call notices from generate()
    new_tokens = 32

    def request(i):
        rnd = random.Random(2_000_003 * i)
        b, s = rnd.randint(1, 16), rnd.randint(32, 1024)
        lengths = [rnd.randint(max(1, s // 2), s) for _ in range(b)]
        gen = torch.Generator().manual_seed(2_000_003 * i)
        ids = torch.randint(3, cfg.vocab_size, (b, s), generator=gen)
        mask = torch.zeros(b, s, dtype=torch.long)
        for r, n in enumerate(lengths):
            mask[r, s - n:] = 1
        ids = ids * mask  # pad token 0 before each prompt
        return ids.to("cuda"), mask.to("cuda")

    def make_state():
        return {}

    def step(state, i):
        ids, mask = request(i)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 use_cache=True)
        return out[:, -1].sum()

    return model, make_state, step


def convnext_timm(torch, args):
    """timm's ConvNeXt-Base built by name (random weights), fixed-shape
    training: batch 64 x 224, AdamW, bf16 autocast, channels-last."""
    import timm

    model = timm.create_model("convnext_base", pretrained=False, num_classes=1000)
    model = model.cuda().to(memory_format=torch.channels_last)
    model.train()
    lossf = torch.nn.CrossEntropyLoss()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make_state():
        return {"opt": torch.optim.AdamW(model.parameters(), lr=1e-4)}

    def step(state, i):
        x = torch.randn(64, 3, 224, 224, device="cuda", generator=gen).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lossf(model(x), y)
        return optimizer_step(state, loss)

    return model, make_state, step


# ---- serving and variable-shape jobs recorded for the memory comparison
# (bench/torch/record_jobs.py): third-party code as users write it.


def random_prompts(torch, vocab_size, seed, batch_range, length_range):
    """A request's prompts on the GPU: batch and length drawn from the
    ranges (inclusive) by a generator seeded with seed, token IDs from 1."""
    import random

    rnd = random.Random(seed)
    b, s = rnd.randint(*batch_range), rnd.randint(*length_range)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (b, s), generator=gen).to("cuda")


def gpt2_generate(torch, args):
    """GPT-2 large (774M) loaded as fp32 on the GPU and converted there to
    bf16 (the job's live peak comes early, while both copies exist), then
    generate() requests: per request batch 4-8 and prompt length 32-256,
    greedy, 256 new tokens; the cache grows by concatenation token by token
    (DynamicCache)."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=1280, n_layer=36, n_head=20, pad_token_id=0)
    with torch.device("cuda"):
        model = GPT2LMHeadModel(cfg)
    model = model.to(torch.bfloat16)
    model.eval()
    transformers.logging.set_verbosity_error()
    new_tokens = 256

    def make_state():
        return {}

    def step(state, i):
        ids = random_prompts(torch, cfg.vocab_size, 3_000_017 * i, (4, 8), (32, 256))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
        return out[:, -1].sum()

    return model, make_state, step


def greedy_decode(n_embd, n_layer, n_head, batch, prompt, new_tokens, family="gpt2"):
    """A workload that loads a decoder in bf16 (built on the host, moved),
    then per step one greedy generate() of a fixed shape: a prefill, then
    every new token concatenated onto each layer's cache (DynamicCache), so
    each token allocates a slightly larger block per layer and frees the
    one before: a stream of ever larger blocks with no reuse."""

    def workload(torch, args):
        import transformers

        if family == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, pad_token_id=0)
            model = GPT2LMHeadModel(cfg)
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(vocab_size=32000, hidden_size=n_embd, intermediate_size=n_embd * 11 // 4,
                              num_hidden_layers=n_layer, num_attention_heads=n_head,
                              num_key_value_heads=max(1, n_head // 4), max_position_embeddings=4096,
                              pad_token_id=0)  # fmt: skip
            model = LlamaForCausalLM(cfg)
        model = model.to("cuda", torch.bfloat16)
        model.eval()
        transformers.logging.set_verbosity_error()

        def make_state():
            return {}

        def step(state, i):
            gen = torch.Generator().manual_seed(1000 + i)
            ids = torch.randint(1, cfg.vocab_size, (batch, prompt), generator=gen).to("cuda")
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
            return out[:, -1].sum()

        return model, make_state, step

    return workload


def gpt2_beam_serve(torch, args):
    """Beam search serving: GPT-2 medium (355M) in bf16, built on the host
    and moved; per request batch 1-8 and prompt length 16-256, 4 beams, 64
    new tokens (the cache is reordered by beam at every token)."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=1024, n_layer=24, n_head=16, pad_token_id=0)
    model = GPT2LMHeadModel(cfg).to("cuda", torch.bfloat16)
    model.eval()
    transformers.logging.set_verbosity_error()

    def make_state():
        return {}

    def step(state, i):
        ids = random_prompts(torch, cfg.vocab_size, 4_000_037 * i, (1, 8), (16, 256))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                                 min_new_tokens=64, num_beams=4, do_sample=False, pad_token_id=0,
                                 use_cache=True, early_stopping=False)
        return out[:, -1].sum()

    return model, make_state, step


def bert_varlen_train(torch, args):
    """BERT-base sequence classification with dynamic padding: per step
    batch 32 and padded length 64-512 (uniform), AdamW, bf16 autocast."""
    import random

    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_labels=4)
    with torch.device("cuda"):
        model = BertForSequenceClassification(cfg)
    model.train()

    def make_state():
        return {"opt": torch.optim.AdamW(model.parameters(), lr=2e-5)}

    def step(state, i):
        rnd = random.Random(5_000_011 * i)
        s = rnd.randint(64, 512)
        gen = torch.Generator().manual_seed(5_000_011 * i)
        ids = torch.randint(1, cfg.vocab_size, (32, s), generator=gen).to("cuda")
        labels = torch.randint(0, 4, (32,), generator=gen).to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        return optimizer_step(state, loss)

    return model, make_state, step


def lora_peft_ckpt(torch, args):
    """PEFT LoRA (r 16 on every projection) over a frozen bf16 1.1B
    Llama-style base (TinyLlama's shape), gradient checkpointing, per step
    batch 4 and length 256-1024, AdamW on the adapters."""
    import random

    import peft
    from transformers import LlamaForCausalLM

    cfg = llama_config(2048, 5632, 22, 32, 4, pad_token_id=0, use_cache=False)
    with torch.device("cuda"):
        base = LlamaForCausalLM(cfg).to(torch.bfloat16)
    base.gradient_checkpointing_enable()
    base.enable_input_require_grads()
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, lora)
    model.train()

    def make_state():
        return {"opt": torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)}

    def step(state, i):
        rnd = random.Random(6_000_001 * i)
        s = rnd.randint(256, 1024)
        gen = torch.Generator().manual_seed(6_000_001 * i)
        ids = torch.randint(1, cfg.vocab_size, (4, s), generator=gen).to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        return optimizer_step(state, loss)

    return model, make_state, step


def graphsage_varlen(torch, args):
    """torch_geometric GraphSAGE (3 layers, hidden 256) on a random graph
    per step: 50,000-200,000 nodes of 128 features, 10 edges per node,
    node classification, AdamW."""
    import random

    from torch_geometric.nn import GraphSAGE

    with torch.device("cuda"):
        model = GraphSAGE(128, 256, num_layers=3, out_channels=16)
    model.train()
    lossf = torch.nn.CrossEntropyLoss()

    def make_state():
        return {"opt": torch.optim.AdamW(model.parameters(), lr=1e-3)}

    def step(state, i):
        rnd = random.Random(7_000_003 * i)
        n = rnd.randint(50_000, 200_000)
        gen = torch.Generator().manual_seed(7_000_003 * i)
        x = torch.randn(n, 128, generator=gen).to("cuda")
        edges = torch.randint(0, n, (2, 10 * n), generator=gen).to("cuda")
        y = torch.randint(0, 16, (n,), generator=gen).to("cuda")
        loss = lossf(model(x, edges), y)
        return optimizer_step(state, loss)

    return model, make_state, step


def resnet_multiscale(torch, args):
    """Multi-scale training as detection recipes do: torchvision ResNet-50,
    batch 32, square images of a side drawn per step from 224-512 (steps of
    32), SGD momentum, bf16 autocast, channels-last."""
    import random

    import torchvision

    with torch.device("cuda"):
        model = torchvision.models.resnet50(weights=None)
    model = model.to(memory_format=torch.channels_last)
    lossf = torch.nn.CrossEntropyLoss()

    def make_state():
        return {"opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}

    def step(state, i):
        side = random.Random(8_000_009 * i).randrange(224, 513, 32)
        gen = torch.Generator(device="cuda").manual_seed(8_000_009 * i)
        x = torch.randn(32, 3, side, side, device="cuda", generator=gen).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (32,), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lossf(model(x), y)
        return optimizer_step(state, loss)

    return model, make_state, step


def distill_side_stream(torch, args):
    """Knowledge distillation with the teacher on a side stream: torchvision's
    ResNet-50 in bf16 inference computes the next batch's soft targets on a
    stream of its own while a ResNet-18 student trains on the current batch
    on the main stream (images 128 x 3 x 288 x 288). The two streams' large
    transient tensors peak at different times: the default arenas are per
    stream, and a stream may lend another its free blocks."""
    import torchvision

    with torch.device("cuda"):
        teacher = torchvision.models.resnet50(weights=None).eval()
        student = torchvision.models.resnet18(weights=None)
    teacher = teacher.to(memory_format=torch.channels_last)
    student = student.to(memory_format=torch.channels_last)
    side = torch.cuda.Stream()
    kl = torch.nn.KLDivLoss(reduction="batchmean")

    def teach(i):
        gen = torch.Generator(device="cuda").manual_seed(9_000_011 * i)
        with torch.cuda.stream(side), torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            x = torch.randn(128, 3, 288, 288, device="cuda", generator=gen).to(memory_format=torch.channels_last)
            return x, teacher(x).float().log_softmax(-1)

    def make_state():
        return {"opt": torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9), "next": None}

    def step(state, i):
        main = torch.cuda.current_stream()
        x, target = state["next"] if state["next"] is not None else teach(i)
        main.wait_stream(side)
        x.record_stream(main)
        target.record_stream(main)
        state["next"] = teach(i + 1)  # overlaps with the student's step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = kl(student(x).float().log_softmax(-1), target.exp())
        del x, target
        return optimizer_step(state, loss)

    return student, make_state, step


WORKLOADS = {
    "gpt2_train": gpt2_train,
    "resnet50_train": resnet50_train,
    "llama_ckpt_train": llama_ckpt_train,
    "t5_varlen_prefetch": t5_varlen_prefetch,
    "llama_finetune_varlen": finetune_varlen((4, 8)),
    "llama_finetune_varlen_half": finetune_varlen((2, 4)),
    "llama_generate_serve": llama_generate_serve,
    "convnext_timm": convnext_timm,
    "gpt2_generate": gpt2_generate,
    "gpt2_beam_serve": gpt2_beam_serve,
    "bert_varlen_train": bert_varlen_train,
    "lora_peft_ckpt": lora_peft_ckpt,
    "graphsage_varlen": graphsage_varlen,
    "resnet_multiscale": resnet_multiscale,
    "distill_side_stream": distill_side_stream,
    # greedy decoding with a dynamic KV cache at four sizes (traces/jobs/README.md)
    "decode_gpt2_b1": greedy_decode(768, 12, 12, batch=1, prompt=64, new_tokens=512),
    "decode_gpt2m_b8": greedy_decode(1024, 24, 16, batch=8, prompt=128, new_tokens=256),
    "decode_gpt2l_b2": greedy_decode(1280, 36, 20, batch=2, prompt=96, new_tokens=320),
    "decode_gpt2_b32_long": greedy_decode(768, 12, 12, batch=32, prompt=64, new_tokens=960),
    "decode_llama_b16": greedy_decode(1536, 16, 16, batch=16, prompt=256, new_tokens=192, family="llama"),
}


class GcClock:
    """Time spent in Python's garbage collector (gc.callbacks), in all and
    per timed step (steps_ms: from mark() to lap())."""

    def __init__(self):
        self.total_ms = 0.0
        self.steps_ms = []
        self._t0 = None
        self._mark = 0.0
        gc.callbacks.append(self._event)

    def mark(self):
        self._mark = self.total_ms

    def lap(self):
        self.steps_ms.append(self.total_ms - self._mark)

    def _event(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total_ms += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None


def run_steps(torch, make_state, step, steps, warmup=0, start=0, issue_ms=None, at_timed=None, gc_clock=None,
              gate=None):
    """Trains warmup + steps steps; returns (per-step ms of the timed ones,
    oom message or None). Also fills issue_ms (when given): per timed step,
    the host time until step() returned, before the loss is read. A step
    whose issue time is well below its step time waited on the GPU: host
    costs such as the allocator's do not lengthen it. at_timed (when given)
    is called once, just before the first timed step. gc_clock (when
    given) gets each timed step's time in the garbage collector.
    gate (when given) is called before each step, the GPU idle, and again
    after it with the step's ms (bench/torch/lockstep_ab.py)."""
    state = make_state()
    times = []
    oom = None
    try:
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            if i == warmup and at_timed is not None:
                at_timed()
            if gate is not None:
                gate(i, None)
            if gc_clock is not None:
                gc_clock.mark()
            t0 = time.perf_counter()
            loss = step(state, start + i)
            t_issued = time.perf_counter()
            loss.item()  # a host sync, as a training loop logging its loss has
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            if gate is not None:
                gate(i, ms)
            if i >= warmup:
                times.append(ms)
                if issue_ms is not None:
                    issue_ms.append((t_issued - t0) * 1e3)
                if gc_clock is not None:
                    gc_clock.lap()
            del loss
    except Exception as e:  # out of memory is a result, anything else a bug
        if not is_oom(torch, e):
            raise
        oom = str(e).splitlines()[0][:300]
    # Drop everything the steps made (optimizer state, gradients, staged
    # batches) outside the except block, so the traceback pins nothing.
    state.clear()
    return times, oom


def release(torch, model):
    for p in model.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--allocator", choices=["native", "expandable", "async", "gpumem"], default="native")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=None)
    ap.add_argument("--conf", default=None, help="GPUMEM_CONF for --allocator gpumem")
    ap.add_argument("--limit", type=int, default=None, metavar="BYTES",
                    help="cap the process's reserved memory at BYTES: gpumem's limit: key under gpumem, "
                         "torch.cuda.set_per_process_memory_fraction(BYTES / device total) otherwise")
    ap.add_argument("--bisect", type=int, default=0, metavar="PROBES")
    ap.add_argument("--lockstep", action="store_true",
                    help="wait for a line on stdin before each step and print 'LOCKSTEP i ms' after it "
                         "(driven by bench/torch/lockstep_ab.py)")
    ap.add_argument("--gc", choices=["on", "freeze"], default="on",
                    help="freeze: gc.collect() and gc.freeze() just before the timed steps")
    ap.add_argument(
        "--probe-steps", type=int, default=None, help="steps per probe (default: warm-up + steps, the same batches)"
    )
    args = ap.parse_args()
    if args.fraction is not None and args.limit is not None:
        ap.error("--fraction and --limit are two ways to say the same thing: give one")
    if args.limit is not None and args.limit <= 0:
        ap.error("--limit must be a positive number of bytes")

    torch = install_allocator(args)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    torch.cuda.init()
    total = torch.cuda.mem_get_info()[1]
    if args.fraction is not None:
        torch.cuda.set_per_process_memory_fraction(args.fraction)
    if args.limit is not None and args.allocator != "gpumem":
        if not 0 < args.limit <= total:
            ap.error("--limit %d is outside (0, %d], the device's memory" % (args.limit, total))
        torch.cuda.set_per_process_memory_fraction(args.limit / total)

    t0 = time.perf_counter()
    model, make_state, step = WORKLOADS[args.workload](torch, args)
    build_s = time.perf_counter() - t0
    issue = []
    counters_before = {}
    keep = ("num_syncs", "num_sync_all_streams", "num_pages_mapped", "num_pages_unmapped", "num_reclaims",
            "num_alloc_retries", "num_device_alloc", "num_device_free", "allocation.all.allocated",
            "num_ooms", "num_plans", "num_plan_drops", "num_planned_allocs", "num_pages_revived",
            "num_pages_aliased", "num_move_guard_trips", "mapping_time_ns", "move_work_us", "limit_bytes")

    def snapshot():
        import gpumem

        counters_before.update(gpumem.memory_stats())

    def before_timed():
        if args.gc == "freeze":
            gc.collect()
            gc.freeze()
        if args.allocator == "gpumem":
            snapshot()

    def lockstep_gate(i, ms):
        if ms is None:
            if not sys.stdin.readline():
                raise SystemExit("lockstep: the driver went away")
        else:
            print(f"LOCKSTEP {i} {ms:.3f}", flush=True)

    gc_clock = GcClock()
    times, oom = run_steps(torch, make_state, step, args.steps, args.warmup, issue_ms=issue, at_timed=before_timed,
                           gc_clock=gc_clock, gate=lockstep_gate if args.lockstep else None)
    result = {
        "workload": args.workload,
        "allocator": args.allocator,
        "conf": gpumem_conf(args) if args.allocator == "gpumem" else None,
        "limit": args.limit,
        "device": torch.cuda.get_device_name(),
        "device_total": total,
        "steps": len(times),
        "median_ms": round(statistics.median(times), 3) if times else None,
        # every timed step, in order: the same seed gives the same shapes per
        # step, so runs of two allocators can be compared step by step
        "step_ms": [round(t, 3) for t in times],
        # host time to issue each timed step (see run_steps)
        "issue_median_ms": round(statistics.median(issue), 3) if issue else None,
        "gc": args.gc,
        "gc_ms": [round(t, 3) for t in gc_clock.steps_ms],  # per timed step, in the garbage collector
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "oom": oom is not None,
        "oom_message": oom,
        "fraction": args.fraction,
        "build_s": round(build_s, 1),
    }

    if args.allocator == "gpumem":
        # Where gpumem's time goes: device calls and synchronizations.
        import gpumem

        st = gpumem.memory_stats()
        result["gpumem"] = {k: st.get(k) for k in keep}
        result["gpumem"]["policy"] = gpumem.allocator().policy  # not a statistic: not in memory_stats
        result["gpumem"].update({k: v for k, v in st.items() if k.startswith("backend_calls.") and v})
        # The same counters over the timed steps alone: device work there is
        # what could lengthen a step.
        if counters_before:
            result["gpumem_timed"] = {
                k: st[k] - counters_before.get(k, 0)
                for k in st
                if (k in keep or k.startswith("backend_calls.")) and isinstance(st[k], int)
                and st[k] != counters_before.get(k, 0)
            }

    if args.bisect > 0 and oom is None:
        # The cap lies between peak allocated (no allocator fits below) and
        # peak reserved (this allocator fitted there without a cap).
        lo, hi = result["peak_allocated"] / total, result["peak_reserved"] / total
        probes = []
        passing = hi
        probe_steps = args.probe_steps or (args.warmup + args.steps)
        for _ in range(args.bisect):
            mid = (lo + hi) / 2
            release(torch, model)
            torch.cuda.set_per_process_memory_fraction(mid)
            _, failed = run_steps(torch, make_state, step, probe_steps, 0)
            probes.append({"fraction": round(mid, 5), "oom": failed is not None})
            if failed is None:
                hi = passing = mid
            else:
                lo = mid
        release(torch, model)
        torch.cuda.set_per_process_memory_fraction(1.0)
        result["min_fraction"] = round(passing, 5)
        result["min_cap_bytes"] = int(passing * total)
        result["probes"] = probes

    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
