"""A user's contrastive script, CLIP-style: an image tower and a text tower,
their batch-by-batch similarity matrix under bf16 autocast, AdamW. The
logits grow with the square of the batch.

    python -m gpumem.predict --memory 80G bench/torch/userjobs/contrastive.py --batch-size {B}
"""

import argparse
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=256)
p.add_argument("--steps", type=int, default=50)
a = p.parse_args()
dev = "cuda"
img = torch.nn.Sequential(torch.nn.Linear(2048, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).to(dev)
txt = torch.nn.Sequential(torch.nn.Embedding(30000, 512), torch.nn.Flatten(1), torch.nn.Linear(512 * 32, 512)).to(dev)
scale = torch.nn.Parameter(torch.tensor(2.659, device=dev))
opt = torch.optim.AdamW(list(img.parameters()) + list(txt.parameters()) + [scale], lr=1e-4)
for step in range(a.steps):
    x = torch.randn(a.batch_size, 2048, device=dev)
    t = torch.randint(0, 30000, (a.batch_size, 32), device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        zi = F.normalize(img(x), dim=-1)
        zt = F.normalize(txt(t), dim=-1)
        logits = scale.exp() * zi @ zt.t()
        labels = torch.arange(a.batch_size, device=dev)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
    loss.backward()
    opt.step()
    opt.zero_grad()
