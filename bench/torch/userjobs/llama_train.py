"""A training script as a user writes one: an HF Llama of about 0.2B
parameters (12 layers, hidden 1024) built from a config, AdamW, bf16
autocast, sequences of 512 tokens, on the GPU when there is one.

    python -m gpumem.predict --memory 79G bench/torch/userjobs/llama_train.py --batch-size {B}
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--steps", type=int, default=100)
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
model = LlamaForCausalLM(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch_size, 512), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step % 10 == 0:
        print("step", step, loss.item())
