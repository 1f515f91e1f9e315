"""An image classifier as a newcomer writes one: a small convolutional
network on 64x64 images, cuDNN's autotuner on, half the GPU for this job
(set_per_process_memory_fraction), a DataLoader with worker processes and
pinned memory, fp16 autocast with a GradScaler, SGD with momentum.

    python -m gpumem.predict --memory 79G bench/torch/userjobs/cnn_capped.py --batch-size {B}
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

ap = argparse.ArgumentParser()
ap.add_argument("--batch-size", type=int, default=64)
ap.add_argument("--steps", type=int, default=20)
args = ap.parse_args()

torch.backends.cudnn.benchmark = True
torch.cuda.set_per_process_memory_fraction(0.5)


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.MaxPool2d(2))


model = nn.Sequential(block(3, 64), block(64, 128), block(128, 256), block(256, 512), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(512, 100)).cuda()


class RandomImages(Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        return torch.randn(3, 64, 64, generator=g), torch.randint(0, 100, (), generator=g)


loader = DataLoader(RandomImages(), batch_size=args.batch_size, shuffle=True, num_workers=2, pin_memory=True,
                    drop_last=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler()
step = 0
while step < args.steps:
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == args.steps:
            break
print(f"loss {loss.item():.4f}")
