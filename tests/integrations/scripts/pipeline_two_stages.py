"""Two ranks under torchrun (gloo). ``fault`` / ``clean``: a two-stage pipeline, one stage per
rank, stage 0 sending its bf16 activations to stage 1, whose head is left in f32 (``fault``: the
real run raises there, on rank 1 only) or in bf16 with the rest (``clean``). ``replicas``: both
ranks run the same model (data parallel), their outputs all-reduced."""

import sys

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank, case = dist.get_rank(), sys.argv[1]
torch.manual_seed(0)
if rank == 0 or case == "replicas":
    stage = nn.Sequential(nn.Linear(16, 16), nn.GELU()).to(torch.bfloat16)
else:
    stage = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).to(torch.bfloat16)
    if case == "fault":
        stage[2].float()
for step in range(2):
    if case == "replicas":
        out = stage(torch.randn(8, 16, dtype=torch.bfloat16))
        dist.all_reduce(out)
        print(f"step {step} sum {out.float().sum().item():.3f}")
    elif rank == 0:
        dist.send(stage(torch.randn(8, 16, dtype=torch.bfloat16)), 1)
    else:
        received = torch.empty(8, 16, dtype=torch.bfloat16)
        dist.recv(received, 0)
        print(f"step {step} loss {stage(received).float().pow(2).mean().item():.3f}")
dist.destroy_process_group()
