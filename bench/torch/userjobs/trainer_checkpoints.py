"""A user's HF Trainer script that saves a checkpoint every step and keeps one
(`save_total_limit=1`) under /tmp/gt: predicting it must neither write
checkpoints nor remove the older ones the Trainer's rotation would.

    python -m gpumem.predict --memory 79G --no-confirm bench/torch/userjobs/trainer_checkpoints.py --batch-size {B}
"""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=8)
args = ap.parse_args()


class RandomTokens(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 30522, (128,), generator=g), "labels": torch.tensor(i % 2)}


model = BertForSequenceClassification(
    BertConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, intermediate_size=1024)
)
training = TrainingArguments(output_dir="/tmp/gt", per_device_train_batch_size=args.batch_size, max_steps=100,
                             report_to=[], save_strategy="steps", save_steps=1, save_total_limit=1,
                             logging_steps=1, disable_tqdm=True)  # fmt: skip
Trainer(model=model, args=training, train_dataset=RandomTokens()).train()
