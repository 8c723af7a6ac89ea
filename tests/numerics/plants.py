"""Small models and planted precision-sensitive modules for the numerics tests."""

from __future__ import annotations

import torch
from torch import nn


class Cancel(nn.Module):
    """Catastrophic cancellation: (h + s) - s with s far larger than h, in h's dtype."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        s = 64 * h.detach().abs().amax()
        return (h + s) - s


class TinyEpsScale(nn.Module):
    """An RMS normalisation of small activations with a tiny epsilon, computed in the input's
    dtype: float16 squares underflow to zero and 1e-12 is zero too, so it divides by zero."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x) * 1e-4
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-12)


class FusedCancel(nn.Module):
    """(h * 256 + h) - h * 256 in h's dtype: eager rounds after each op and loses most of h in
    bf16; Inductor fuses the chain into one float32 kernel and keeps it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        big = h * 256.0
        return (big + h) - big


class Mlp(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(self.norm(h))


def mlp(plant: type[nn.Module] | None = None, where: int = 1) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = Mlp()
    if plant is not None:
        model.layers[where][0] = plant(model.layers[where][0])
    return model, (torch.randn(8, 16),)


def encoder() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True, dropout=0.1)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (torch.randn(2, 6, 32),)
