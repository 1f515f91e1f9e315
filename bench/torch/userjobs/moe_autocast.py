"""A user's mixture-of-experts script: a small Mixtral-style model (4 layers,
8 experts, 2 per token) built from a config in float32 and trained under
bf16 autocast with AdamW, 256 tokens. transformers runs its experts through
torch._grouped_mm, in float32 here (it casts the tokens to the experts'
type), which CUDA runs and PyTorch's meta function refuses.

    python -m gpumem.predict --memory 80G bench/torch/userjobs/moe_autocast.py --batch-size {B}
"""

import argparse

import torch
from transformers import MixtralConfig, MixtralForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()
cfg = MixtralConfig(vocab_size=8000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=1024)
model = MixtralForCausalLM(cfg).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(args.steps):
    ids = torch.randint(0, 8000, (args.batch_size, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.4f}")
