"""A user's generation script: a GPT-2 of a chosen size (random weights from
its configuration), greedy generate() with transformers' default dynamic KV
cache, repeated a few times at one shape. Each new token is concatenated onto every
layer's cache, so each token frees a block per layer and makes one a token
longer: a stream of ever larger blocks after the weights and a prefill.

    python -m gpumem.predict --memory 80G bench/torch/userjobs/greedy_decode.py --batch-size {B}
    python bench/torch/userjobs/greedy_decode.py --model gpt2-large --dtype fp32 --load device
"""
import argparse

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

SIZES = {  # n_embd, n_layer, n_head: the four published GPT-2 shapes
    "gpt2": (768, 12, 12),
    "gpt2-medium": (1024, 24, 16),
    "gpt2-large": (1280, 36, 20),
    "gpt2-xl": (1600, 48, 25),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--model", choices=sorted(SIZES), default="gpt2")
p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
p.add_argument("--new-tokens", type=int, default=256)
p.add_argument("--repeats", type=int, default=2, help="generate() runs, one shape")
p.add_argument("--load", choices=["host", "device"], default="host",
               help="host: built on the CPU and moved in --dtype; device: built in fp32 on the GPU, converted there")
args = p.parse_args()

n_embd, n_layer, n_head = SIZES[args.model]
transformers.logging.set_verbosity_error()
cfg = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, pad_token_id=0,
                 n_positions=max(1024, args.prompt + args.new_tokens))
if args.load == "device":
    with torch.device("cuda"):
        model = GPT2LMHeadModel(cfg)
    model = model.to(DTYPES[args.dtype])
else:
    model = GPT2LMHeadModel(cfg).to("cuda", DTYPES[args.dtype])
model.eval()
total = 0.0
for i in range(args.repeats):
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(1, cfg.vocab_size, (args.batch_size, args.prompt), generator=g).to("cuda")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
    total += float(out[:, -1].sum())
print("generated", args.repeats, "x", tuple(out.shape), total)
