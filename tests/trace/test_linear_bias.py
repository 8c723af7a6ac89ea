"""nn.Linear with a bias in another dtype and a non-contiguous 3-d input: ATen's linear takes its
matmul path and adds a plain bias in place (the product's dtype stays), a fake tensor's out of
place (promoted). The audit must follow the real tensors (a false alarm otherwise: diffusers'
VAE attention with a bias re-created in f32 runs for real)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.next = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x.transpose(1, 2))  # a non-contiguous 3-d input
        return self.next(h)


def _model(bias: torch.dtype) -> nn.Module:
    model = Transposed().to(torch.bfloat16)
    model.proj.bias = nn.Parameter(model.proj.bias.detach().to(bias))
    return model


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_real_linear_keeps_the_product_dtype_and_the_audit_agrees(mode: str) -> None:
    x = torch.randn(2, 8, 5, dtype=torch.bfloat16)
    real = _model(torch.float32)
    out = real.proj(x.transpose(1, 2))
    assert out.dtype == torch.bfloat16  # the measured fact the tracer follows
    real(x).float().sum().backward() if mode == "train" else real.eval()(x)  # runs for real
    report = castwise.audit(_model(torch.float32), x, mode=mode)
    assert report.ok, [f.message for f in report.errors]


def test_a_contiguous_input_still_meets_the_addmm_check() -> None:
    # contiguous 3-d input: the fused addmm path, which refuses an f32 bias on bf16 (as for real)
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    model = Plain().to(torch.bfloat16)
    model.proj.bias = nn.Parameter(model.proj.bias.detach().float())
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        model(x)
    assert not castwise.audit(model, x, mode="eval").ok
