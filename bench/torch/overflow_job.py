"""One run of the overflow tier's benchmark (bench/torch/overflow_caps.sh):
a Llama-style fine-tune (transformers' LlamaForCausalLM built from a
configuration, no download; bf16 autocast, AdamW, deterministic
algorithms, the same batches every run) for --steps steps, in one of four
ways:

    uncapped    gpumem's default, no cap: the reference (losses, step time,
                peak reserved and allocated)
    overflow    gpumem with GPUMEM_CONF=overflow:host,limit:CAP: what does not
                fit under the cap goes to host pages (src/overflow.c)
    microbatch  gpumem with limit:CAP and gpumem.torch.microbatch: a step that
                runs out of memory goes on as k micro-batches, same effective
                batch
    fsdp        FSDP2 (fully_shard) over one GPU (world size 1) with
                CPUOffloadPolicy: parameters, gradients and optimizer state on
                the host; gpumem with limit:CAP serves what stays on the GPU

    python bench/torch/overflow_job.py --mode MODE [--cap BYTES] --out RUN.json

Writes RUN.json: the mode, the cap, every step's loss (as float32 bits in
hex, so bit equality is exact) and time, the median step time, peak
reserved and allocated, and gpumem's overflow figures (host bytes, moves
both ways). A run that fails (out of memory, an error) writes its error
instead and exits 0, so that the driver's table says what happened."""

import argparse
import json
import os
import struct
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A ~0.2 B-parameter Llama: the optimizer state (fp32 AdamW moments) and
# the master weights are about as large as the activations of one step at
# this batch, the shape of a fine-tune whose state is worth moving.
MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)  # fmt: skip


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("uncapped", "overflow", "microbatch", "fsdp"), required=True)
    ap.add_argument("--cap", type=int, default=0, help="gpumem's limit in bytes (0: none)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--fsdp-steps", type=int, default=10,
                    help="steps of --mode fsdp (its optimizer steps on the CPU: seconds each)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--optimizer", choices=("foreach", "fused"), default="foreach",
                    help="AdamW's implementation: foreach (PyTorch's default on CUDA: several "
                         "kernels a step, each reading the state) or fused (one kernel a step)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.mode != "uncapped" and a.cap <= 0:
        ap.error("--cap is needed for --mode %s" % a.mode)
    return a


def conf_of(a):
    parts = []
    if a.mode == "overflow":
        parts.append("overflow:host")
    if a.cap:
        parts.append("limit:%d" % a.cap)
    return ",".join(parts) or None


def float_bits(x):
    return struct.pack(">f", x).hex()


def main(argv=None):
    a = parse(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.path.insert(0, os.path.join(REPO, "python"))
    import gpumem.torch

    gpumem.torch.enable(conf_of(a))
    import torch

    result = {"mode": a.mode, "cap": a.cap, "conf": conf_of(a), "steps": a.steps, "batch": a.batch,
              "seq": a.seq, "optimizer": a.optimizer, "model": MODEL, "device": torch.cuda.get_device_name(0)}  # fmt: skip
    try:
        run(torch, gpumem, a, result)
    except Exception as exc:  # the table says what happened; the next run goes on
        result["error"] = "%s: %s" % (type(exc).__name__, str(exc)[:2000])
        result["traceback"] = traceback.format_exc()[-4000:]
    stats = torch.cuda.memory_stats()
    for k in ("host_bytes.all.peak", "host_bytes.all.current", "num_host_allocs", "num_moves_to_host",
              "bytes_moved_to_host", "move_to_host_ns", "num_moves_to_device", "bytes_moved_to_device",
              "move_to_device_ns", "num_ooms", "num_alloc_retries", "num_host_pages_reused",
              "host_cached_bytes.all.peak"):  # fmt: skip
        result[k] = stats.get(k)
    result["peak_reserved"] = torch.cuda.max_memory_reserved()
    result["peak_allocated"] = torch.cuda.max_memory_allocated()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result.get(k) for k in ("mode", "cap", "median_step_s", "peak_reserved",
                                                  "host_bytes.all.peak", "error")}))  # fmt: skip


def batches(torch, a, vocab):
    """The same token batches in every run: drawn on the CPU from one seed."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (a.batch, a.seq), generator=g) for _ in range(a.steps)]


def run(torch, gpumem, a, result):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # warn_only: an op without a deterministic kernel warns rather than
    # stopping the run; the losses then say whether the runs agreed
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    # eager attention: plain matmuls and softmax, deterministic in both
    # directions (the fused kernels' backward need not be)
    cfg = LlamaConfig(use_cache=False, attn_implementation="eager", **MODEL)
    cfg._attn_implementation = "eager"
    if a.mode == "fsdp":
        a.steps = min(a.steps, a.fsdp_steps)
        result["steps"] = a.steps
    data = batches(torch, a, cfg.vocab_size)
    if a.mode == "fsdp":
        model, opt = build_fsdp(torch, cfg)
    else:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{a.optimizer: True})
    model.train()

    def loss_fn(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss

    step_mb = gpumem.torch.microbatch(loss_fn, opt, model=model) if a.mode == "microbatch" else None
    losses, times, ks = [], [], []
    for i in range(a.steps):
        ids = data[i].cuda(non_blocking=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if step_mb is not None:
            loss = step_mb(ids)
            ks.append(step_mb.last_k)
        else:
            loss = loss_fn(ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        value = float(loss.detach().float().item())  # synchronizes: the step's time is whole
        times.append(time.perf_counter() - t0)
        losses.append(float_bits(value))
    result["losses"] = losses
    result["step_s"] = times
    if ks:
        result["microbatches"] = ks
    # the first steps allocate the optimizer state and warm the caches
    timed = sorted(times[5:] if len(times) > 10 else times[2:] if len(times) > 4 else times)
    result["median_step_s"] = timed[len(timed) // 2]
    if a.mode == "fsdp":
        torch.distributed.destroy_process_group()


def build_fsdp(torch, cfg):
    """FSDP2 over world size 1 with CPUOffloadPolicy: the sharded state on the
    host, each layer's parameters brought to the GPU for its compute."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from transformers import LlamaForCausalLM

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    model = LlamaForCausalLM(cfg)  # built on the CPU with the same seed: the same initial weights
    policy = CPUOffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


if __name__ == "__main__":
    main()
