"""A small training script as users write one, for gpumem.predict's
walk-through in the README: a 4-layer GPT-2 built from a config, AdamW,
bf16 autocast, sequences of 512 tokens, on the GPU when there is one.

    python -m gpumem.predict --cpu --memory 80G --batch-sizes 2,4,8 --batch 64 \\
        bench/torch/predict_example.py --batch-size {B}
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--steps", type=int, default=100)
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=512, n_head=8)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(args.steps):
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, 512), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
