"""DDP over two gloo processes whose replicas differ in one layer's dtype (rank 1 left it in f32):
DDP's construction broadcasts rank 0's parameters and buffers into each rank's own, and fails there."""

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
if dist.get_rank() == 1:
    model[1].float()
nn.parallel.DistributedDataParallel(model)
print(f"rank {dist.get_rank()} built DDP")
dist.destroy_process_group()
