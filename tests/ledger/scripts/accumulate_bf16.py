"""A pure-bf16 training script: AdamW at lr 1e-5 on bf16 weights (the updates round away), and 128
micro-batches' gradients summed into bf16 .grad per step (``--fixed``: f32 weights under bf16
autocast, gradients in f32)."""

import sys

import torch
from torch import nn

fixed = "--fixed" in sys.argv
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
if not fixed:
    model = model.bfloat16()
head = list(model[2].parameters())
body = list(model[0].parameters())
opt = torch.optim.AdamW([{"params": body, "lr": 1e-5}, {"params": head, "lr": 1e-5}])
for _step in range(2):
    for _micro in range(128):
        x = torch.randn(8, 32)
        with torch.autocast("cpu", torch.bfloat16, enabled=fixed):
            out = model(x if fixed else x.bfloat16())
        out.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("done")
