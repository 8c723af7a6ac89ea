"""bf16 weights whose gradients accumulate in f32 (param.grad_dtype), stepped by torch's AdamW: the
step raises (its bf16 state meets the f32 gradient in lerp_). ``--fixed``: f32 master weights under
bf16 autocast."""

import sys

import torch
from torch import nn

fixed = "--fixed" in sys.argv
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
if not fixed:
    model = model.bfloat16()
    for p in model[2].parameters():
        p.grad_dtype = torch.float32
opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-3}])


def loss(batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16, enabled=fixed):
        return model(batch if fixed else batch.bfloat16()).float().pow(2).mean()


for batch in torch.randn(2, 8, 32):
    loss(batch).backward()
    opt.step()
    opt.zero_grad()
print("done")
