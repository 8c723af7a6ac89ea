"""Model targets for `castwise ledger` tests (the `castwise audit` TARGET syntax)."""

from __future__ import annotations

import torch
from torch import nn


def bf16_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 8)).bfloat16()
    model[1].float()  # a norm kept in f32: its own ledger row
    return model, torch.randn(2, 64)
