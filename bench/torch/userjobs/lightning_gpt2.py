"""A Lightning job as its users write one: GPT-2 small (124M) as a
LightningModule on random tokens of length 512, bf16-mixed precision,
AdamW.

    python -m gpumem.predict --memory 79G bench/torch/userjobs/lightning_gpt2.py --batch-size {B}
"""

import argparse

import lightning as L
import torch
from transformers import GPT2Config, GPT2LMHeadModel

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--steps", type=int, default=20)
args = ap.parse_args()


class LanguageModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config())

    def training_step(self, batch, index):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


tokens = torch.randint(0, 50257, (1 << 16, 512), generator=torch.Generator().manual_seed(0))
data = torch.utils.data.DataLoader(tokens, batch_size=args.batch_size)
gpu = torch.cuda.is_available()
trainer = L.Trainer(max_steps=args.steps, accelerator="gpu" if gpu else "cpu", devices=1,
                    precision="bf16-mixed" if gpu else "32-true", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(LanguageModel(), data)
