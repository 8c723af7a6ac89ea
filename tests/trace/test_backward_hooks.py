"""Tensor hooks in the engine-free backward (simulated CUDA): they run where the engine runs them
and a hook that changes a gradient's dtype is refused with the engine's own error, as on a real
GPU (measured on an H100: "hook '<lambda>' has changed the type of value (was CUDABFloat16Type
got torch.cuda.FloatTensor)")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise


class ActivationHook(nn.Module):
    def __init__(self, to: torch.dtype | None) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.to_dtype = to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad and self.to_dtype is not None:
            h.register_hook(lambda g: g.to(self.to_dtype))
        return self.b(h)


def _real_raises(model: nn.Module, x: torch.Tensor) -> str | None:
    try:
        model(x).float().sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_activation_hook_changing_dtype_is_found_on_every_device(device: str) -> None:
    model = ActivationHook(torch.float32).to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    real = _real_raises(ActivationHook(torch.float32).to(torch.bfloat16), x)
    assert real is not None and "has changed the type of value" in real
    report = castwise.audit(model, x, device=device, mode="train")
    assert not report.ok
    assert any("has changed the type of value" in f.message for f in report.errors)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_parameter_hook_changing_dtype_is_found_on_every_device(device: str) -> None:
    model = ActivationHook(None).to(torch.bfloat16)
    model.a.weight.register_hook(lambda g: g.float())
    report = castwise.audit(model, torch.randn(2, 8, dtype=torch.bfloat16), device=device, mode="train")
    assert not report.ok
    assert any("has changed the type of value" in f.message for f in report.errors)


def test_hooks_that_keep_the_dtype_run_and_pass_on_simulated_cuda() -> None:
    seen: list[torch.dtype] = []
    model = ActivationHook(None).to(torch.bfloat16)
    model.a.weight.register_hook(lambda g: seen.append(g.dtype) or g * 2)
    report = castwise.audit(model, torch.randn(2, 8, dtype=torch.bfloat16), device="cuda", mode="train")
    assert report.ok
    assert seen == [torch.bfloat16]  # the hook ran once, in the engine-free backward
    # and left nothing behind: register_hook is torch's own again
    assert torch.Tensor.register_hook.__module__ == "torch._tensor"
