"""A training loop in the style of Accelerate's examples (written for castwise's tests: a tiny
model, CPU, random data): ``Accelerator(mixed_precision=...)`` (``--mixed_precision``; without
it, ``ACCELERATE_MIXED_PRECISION`` as ``accelerate launch`` sets it), ``accelerator.prepare``,
``accelerator.backward``."""

import argparse

import torch
from accelerate import Accelerator
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--mixed_precision", default=None)
args = p.parse_args()

accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for step, x in enumerate(data):
    loss = model(x).float().pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.print(f"step {step} loss {loss.item():.6f} ({accelerator.mixed_precision})")
