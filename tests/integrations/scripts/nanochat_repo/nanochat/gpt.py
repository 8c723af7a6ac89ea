"""A tiny GPT-ish block computing in nanochat's import-time COMPUTE_DTYPE."""

import torch
from torch import nn

from nanochat.common import COMPUTE_DTYPE


class GPT(nn.Module):
    def __init__(self, planted: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.planted = planted

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx).to(COMPUTE_DTYPE)
        h = nn.functional.linear(x, self.fc.weight.to(COMPUTE_DTYPE), self.fc.bias.to(COMPUTE_DTYPE))
        # the planted fault: the head's weight used as stored (f32), which only the GPU's bf16 meets
        w = self.lm_head.weight if self.planted else self.lm_head.weight.to(COMPUTE_DTYPE)
        return nn.functional.linear(h, w).float()
