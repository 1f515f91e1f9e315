"""A training job written for torchrun, as users write them: DDP or FSDP2
(fully_shard) over a small MLP or a Llama-style decoder, AdamW.

    torchrun --nproc-per-node N bench/torch/fsdp_job.py --strategy fsdp2|ddp
        [--model mlp|llama-tiny|llama-1b|bert-base] --batch-size B [--seq-len L] [--steps S]
        [--checkpointing] [--cpu-offload] [--bf16] [--memory-fraction F] [--report PATH.json]

Reads RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them, calls
init_process_group("nccl"), builds the model (a Llama on the meta device,
sharded or wrapped, then materialised with to_empty and initialised, as
FSDP2 recipes do for models too large for one GPU's memory), and trains
--steps steps of --batch-size sequences (or rows) per rank. With --report
each rank writes PATH (rank 0) or PATH.rankN.json: the peak reserved and
allocated bytes (torch.cuda.max_memory_reserved/allocated), memory_reserved
after the model is built, and the job's settings. It is also the job
`python -m gpumem.predict --gpus 1,2,4,8 --memory 80G bench/torch/fsdp_job.py
--batch-size {B} ...` predicts, with no GPU.

Models: mlp, three Linear layers of 16 -> 33 -> 8 -> 6 (shapes that do not
divide among 2, 4 or 8 ranks: FSDP2 pads the shards, the last ranks hold
fewer rows or none); llama-tiny, a 2-layer decoder of width 64
(transformers); llama-1b, Llama 3.2 1B's shape (16 layers of width 2048,
vocabulary 128,256, tied embeddings: 1.24e9 parameters); bert-base, BERT-base
classifying sequences into 2 classes (transformers, 12 layers of width 768:
1.1e8 parameters; DDP only), built on the GPU as DDP jobs usually are.

--checkpointing recomputes each layer's activations in the backward
(torch.utils.checkpoint, non-reentrant); --cpu-offload keeps FSDP2's
sharded parameters, gradients and optimizer state on the CPU
(CPUOffloadPolicy); --bf16 runs FSDP2 with bf16 parameters for compute and
fp32 gradient reduction (MixedPrecisionPolicy), DDP under bf16 autocast.
--memory-fraction caps each rank's caching allocator at that share of its
GPU (torch.cuda.set_per_process_memory_fraction): a batch that does not fit
ends in torch.OutOfMemoryError, and torchrun stops the other ranks."""

import argparse
import json
import os
import sys

MLP_DIMS = (16, 33, 8, 6)
LLAMA = {
    "llama-tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     tie_word_embeddings=True),
}  # fmt: skip


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", choices=("fsdp2", "ddp"), required=True)
    ap.add_argument("--model", choices=("mlp",) + tuple(LLAMA) + ("bert-base",), default="mlp")
    ap.add_argument("--batch-size", type=int, required=True, help="sequences (or rows) per rank and step")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (Llama and BERT models; BERT at most 512)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--checkpointing", action="store_true", help="recompute each layer in the backward")
    ap.add_argument("--cpu-offload", action="store_true", help="FSDP2's CPUOffloadPolicy")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (FSDP2 mixed precision, DDP autocast)")
    ap.add_argument("--memory-fraction", type=float, help="cap each rank at this share of its GPU")
    ap.add_argument("--report", help="write this rank's peak memory as JSON here")
    a = ap.parse_args(argv)
    if a.batch_size < 1 or a.seq_len < 1 or a.steps < 1:
        ap.error("--batch-size, --seq-len and --steps must be at least 1")
    if a.cpu_offload and a.strategy != "fsdp2":
        ap.error("--cpu-offload is FSDP2's (CPUOffloadPolicy)")
    if a.model == "bert-base" and a.strategy != "ddp":
        ap.error("--model bert-base is for --strategy ddp")
    if a.model == "bert-base" and a.seq_len > 512:
        ap.error("--seq-len: BERT-base takes at most 512 tokens")
    if a.memory_fraction is not None and not 0 < a.memory_fraction <= 1:
        ap.error("--memory-fraction must be in (0, 1]")
    return a


class Mlp:
    """Three Linear layers, ReLU between, each block checkpointed with
    --checkpointing."""

    @staticmethod
    def build(torch, checkpointing):
        nn = torch.nn

        class Block(nn.Module):
            def __init__(self, d_in, d_out, last):
                super().__init__()
                self.linear = nn.Linear(d_in, d_out)
                self.last = last

            def forward(self, x):
                y = self.linear(x)
                return y if self.last else torch.relu(y)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                dims = MLP_DIMS
                self.layers = nn.ModuleList(Block(dims[i], dims[i + 1], i == len(dims) - 2)
                                            for i in range(len(dims) - 1))  # fmt: skip

            def forward(self, x):
                for layer in self.layers:
                    if checkpointing:
                        x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
                    else:
                        x = layer(x)
                return x

        return Net()


def build_llama(torch, name, checkpointing):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(use_cache=False, **LLAMA[name])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def build_bert(torch, checkpointing):
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(num_labels=2))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def init_llama(torch, model):
    """Values for a Llama materialised from the meta device (to_empty): the
    initialisation transformers gives (normal(0, 0.02) weights, zero biases,
    unit norms) and the rotary embedding's frequencies."""
    nn = torch.nn
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif type(m).__name__.endswith("RMSNorm"):
                m.weight.fill_(1.0)
        rot = model.model.rotary_emb
        inv_freq, _ = rot.compute_default_rope_parameters(rot.config)
        rot.inv_freq.copy_(inv_freq)
        rot.original_inv_freq.copy_(inv_freq)


def layers_of(model):
    return model.layers if hasattr(model, "layers") else model.model.layers


def main(argv=None):
    a = parse(argv)
    import torch
    import torch.distributed as dist

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if a.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(a.memory_fraction, device)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    llama, bert = a.model in LLAMA, a.model == "bert-base"
    if llama:
        model = build_llama(torch, a.model, a.checkpointing)
    else:
        model = (build_bert(torch, a.checkpointing) if bert else Mlp.build(torch, a.checkpointing)).to(device)
    if a.strategy == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw = {}
        if a.bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if a.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        for layer in layers_of(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        if llama:
            # sharded on the meta device: now each rank's shards get memory and values
            model.to_empty(device="cpu" if a.cpu_offload else device)
            init_llama(torch, model)
    else:
        from torch.nn.parallel import DistributedDataParallel

        if llama:
            model.to_empty(device=device)
            init_llama(torch, model)
        model = DistributedDataParallel(model, device_ids=[local])
    built_reserved = torch.cuda.memory_reserved(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rank)
    autocast = a.bf16 and a.strategy == "ddp"
    for _ in range(a.steps):
        if llama:
            ids = torch.randint(0, LLAMA[a.model]["vocab_size"], (a.batch_size, a.seq_len), generator=gen)
            ids = ids.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
        elif bert:
            ids = torch.randint(0, 30522, (a.batch_size, a.seq_len), generator=gen).to(device)
            labels = torch.randint(0, 2, (a.batch_size,), generator=gen).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=labels).loss
        else:
            x = torch.randn(a.batch_size, MLP_DIMS[0], generator=gen).to(device)
            y = torch.randint(0, MLP_DIMS[-1], (a.batch_size,), generator=gen).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if a.report:
        torch.cuda.synchronize(device)
        out = {
            "rank": rank, "world_size": world, "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__, "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
            "settings": vars(a), "built_reserved": built_reserved,
            "peak_reserved": torch.cuda.max_memory_reserved(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "params": sum(p.numel() for p in model.parameters()), "pid": os.getpid(),
        }  # fmt: skip
        path = a.report if rank == 0 else "%s.rank%d.json" % (a.report, rank)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
