"""A training script in an older style, as many are found: GPT-2 (6 layers)
wrapped in DataParallel, batches from a DataLoader with worker processes and
pinned memory, bf16 autocast, AdamW, the profiler over the first steps, and
a greedy generate() under inference_mode at the end.

    python -m gpumem.predict --memory 79G bench/torch/userjobs/gpt2_dataparallel.py --batch-size {B}
"""

import argparse

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--length", type=int, default=512)
args = ap.parse_args()


class RandomText(Dataset):
    def __len__(self):
        return 1 << 14

    def __getitem__(self, index):
        return torch.randint(0, 50257, (args.length,), generator=torch.Generator().manual_seed(index))


model = torch.nn.DataParallel(GPT2LMHeadModel(GPT2Config(n_layer=6)).cuda())
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
loader = DataLoader(RandomText(), batch_size=args.batch_size, shuffle=True, num_workers=2, pin_memory=True,
                    drop_last=True)
profiler = torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
    schedule=torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=1))
with profiler:
    for step, batch in enumerate(loader):
        batch = batch.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        profiler.step()
        if step + 1 == args.steps:
            break
print(f"loss {loss.item():.4f}")
with torch.inference_mode():
    text = model.module.generate(batch[:, :64], max_new_tokens=64, do_sample=False, pad_token_id=0)
print("generated", tuple(text.shape))
