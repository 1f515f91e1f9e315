"""A user's GAN script: a generator and a discriminator, each with its own
Adam, stepped in turn every iteration; the generator's pass (4 x the batch)
is the iteration's peak.

    python -m gpumem.predict --memory 80G bench/torch/userjobs/gan_two_optimizers.py --batch-size {B}
"""

import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--steps", type=int, default=100, help="iterations")
a = p.parse_args()

G = nn.Sequential(nn.Linear(128, 4096), nn.ReLU(), nn.Linear(4096, 3 * 64 * 64), nn.Tanh()).cuda()
D = nn.Sequential(nn.Linear(3 * 64 * 64, 1024), nn.LeakyReLU(0.2), nn.Linear(1024, 1)).cuda()
opt_g = torch.optim.Adam(G.parameters(), 2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), 2e-4, betas=(0.5, 0.999))
bce = nn.BCEWithLogitsLoss()
for it in range(a.steps):
    real = torch.randn(a.batch_size, 3 * 64 * 64, device="cuda")
    fake = G(torch.randn(a.batch_size, 128, device="cuda"))
    # the discriminator on real and generated images
    opt_d.zero_grad()
    ones = torch.ones(a.batch_size, 1, device="cuda")
    loss_d = bce(D(real), ones) + bce(D(fake.detach()), torch.zeros_like(ones))
    loss_d.backward()
    opt_d.step()
    # the generator, on a larger batch of its own
    opt_g.zero_grad()
    z = torch.randn(4 * a.batch_size, 128, device="cuda")
    loss_g = bce(D(G(z)), torch.ones(4 * a.batch_size, 1, device="cuda"))
    loss_g.backward()
    opt_g.step()
print("loss_d %.4f loss_g %.4f" % (loss_d.item(), loss_g.item()))
