"""Quantised base weights under low-rank adapters (QLoRA): a torchao NF4 weight keeps its own
dtype by design, so a mixed policy's "params in f32" is not asked of it (no CW122); the adapters
are still held to the policy."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

import castwise


class _QLoRA(nn.Module):
    def __init__(self, dim: int = 128, rank: int = 8, *, adapter_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(to_nf4(torch.randn(dim, dim, dtype=torch.bfloat16)), requires_grad=False)
        self.lora_a = nn.Linear(dim, rank, bias=False, dtype=adapter_dtype)
        self.lora_b = nn.Linear(rank, dim, bias=False, dtype=adapter_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


def _model(adapter_dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_QLoRA(adapter_dtype=adapter_dtype), nn.ReLU(), _QLoRA(adapter_dtype=adapter_dtype))


def test_nf4_base_weight_is_not_held_to_the_mixed_policy_param_dtype() -> None:
    model, x = _model(), torch.randn(4, 128)
    real = copy.deepcopy(model)
    with torch.autocast("cpu", torch.bfloat16):  # truth: the real QLoRA step trains on CPU
        y = real(x)
    y.float().sum().backward()
    for fake in (True, False):
        report = castwise.audit(model, x, policy="bf16-mixed", fake=fake)
        assert [f.code for f in report.findings if f.severity in ("error", "warning")] == []


def test_adapters_off_the_policy_are_still_reported() -> None:
    report = castwise.audit(_model(torch.bfloat16), torch.randn(4, 128), policy="bf16-mixed")
    flagged = [f for f in report.findings if f.code == "CW122"]
    assert flagged and "lora_a" in flagged[0].message and "`0.weight`" not in flagged[0].message
