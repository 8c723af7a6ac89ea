"""Model targets for `castwise ledger` tests (the `castwise audit` TARGET syntax)."""

from __future__ import annotations

import torch
from torch import nn


def bf16_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 8)).bfloat16()
    model[1].float()  # a norm kept in f32: its own ledger row
    return model, torch.randn(2, 64)


class WideStateAdam(torch.optim.Optimizer):
    """Adam keeping f32 moments for bf16 parameters (the usual hand-written mixed-precision Adam)."""

    def __init__(self, params: object, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                g = p.grad.float()
                st["exp_avg"].mul_(0.9).add_(g, alpha=0.1)
                st["exp_avg_sq"].mul_(0.999).addcmul_(g, g, value=0.001)
                upd = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + 1e-8)
                p.add_((-group["lr"] * upd).to(p.dtype))
