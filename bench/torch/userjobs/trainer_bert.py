"""A fine-tune as HF Trainer users write one: BERT-base sequence
classification on random token ids of length 256, bf16, AdamW (the
Trainer's default optimizer), batches placed by Accelerate.

    python -m gpumem.predict --memory 79G bench/torch/userjobs/trainer_bert.py --batch-size {B}
"""

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--auto-find-batch-size", action="store_true",
                help="the Trainer's own search: from --batch-size, halved at each out-of-memory error")
args = ap.parse_args()


class RandomTokens(Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 30522, (256,), generator=g), "labels": torch.tensor(i % 2)}


model = BertForSequenceClassification(BertConfig())
with tempfile.TemporaryDirectory() as out:
    training = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                                 bf16=torch.cuda.is_available(), report_to=[], save_strategy="no",
                                 logging_steps=10, disable_tqdm=True,
                                 auto_find_batch_size=args.auto_find_batch_size)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens())
    trainer.train()
    print("batch size trained at:", trainer._train_batch_size)
