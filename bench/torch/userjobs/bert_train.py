"""A newcomer's training script: a 4-layer BERT for sequence
classification built from a config, AdamW, 128 tokens, on the GPU when
there is one.

    python -m gpumem.predict --memory 79G bench/torch/userjobs/bert_train.py --batch-size {B}
"""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=32)
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = BertForSequenceClassification(BertConfig(num_hidden_layers=4, num_labels=2)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
model.train()
for epoch in range(3):
    for step in range(50):
        ids = torch.randint(0, 30522, (args.batch_size, 128), device=device)
        labels = torch.randint(0, 2, (args.batch_size,), device=device)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    print("epoch", epoch, out.loss.item())
