"""A user's evaluation script: a 4-layer BERT classifier over 5,000 samples of
128 tokens, no training, accuracy at the end.

    python -m gpumem.predict --memory 80G bench/torch/userjobs/bert_eval.py --batch-size {B}
"""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--steps", type=int, default=0, help="batches to evaluate (0: the whole set)")
a = p.parse_args()

model = BertForSequenceClassification(BertConfig(num_hidden_layers=4)).cuda().eval()
data = torch.utils.data.TensorDataset(torch.randint(0, 30000, (5000, 128)), torch.randint(0, 2, (5000,)))
correct = seen = 0
with torch.no_grad():
    for i, (ids, labels) in enumerate(torch.utils.data.DataLoader(data, batch_size=a.batch_size)):
        if a.steps and i == a.steps:
            break
        logits = model(input_ids=ids.cuda()).logits
        correct += (logits.argmax(-1).cpu() == labels).sum().item()
        seen += len(labels)
print("accuracy %.4f over %d samples" % (correct / seen, seen))
