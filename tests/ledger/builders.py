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


class KahanAdamW(torch.optim.Optimizer):
    """AdamW with Kahan-compensated updates of 16-bit weights (as optimi's ``kahan_sum=True``): a
    ``kahan_comp`` buffer in the weight's dtype carries what rounding the weight lost."""

    def __init__(self, params: object, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:  # state in the weight's dtype, as optimi keeps it (computed in f32)
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                    st["kahan_comp"] = torch.zeros_like(p)
                st["step"] += 1
                g = p.grad.float()
                m = st["exp_avg"].float().mul_(b1).add_(g, alpha=1 - b1)
                v = st["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                st["exp_avg"].copy_(m)
                st["exp_avg_sq"].copy_(v)
                m_hat = m / (1 - b1 ** st["step"])
                v_hat = v / (1 - b2 ** st["step"])
                y = -group["lr"] * m_hat / (v_hat.sqrt() + 1e-8) + st["kahan_comp"].float()
                old = p.float().clone()  # (for an f32 weight, .float() is the weight itself)
                p.copy_(old + y)
                st["kahan_comp"].copy_(y - (p.float() - old))  # what the rounding lost, added next step


def f16_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 8)).half(), torch.randn(2, 64).half()
