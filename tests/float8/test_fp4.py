"""NVFP4 and MXFP4 emulated bit for bit as torchao quantizes them, and apply/remove with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise
from castwise.float8 import fp4


def test_e2m1_grid_rounds_to_nearest_even() -> None:
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, -0.75, -5.0])
    want = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0])
    assert torch.equal(fp4.round_e2m1(x), want)


def _data(dtype: torch.dtype, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(scale * 1000) % 97)
    x = torch.randn(32, 128, generator=g) * scale * torch.exp(2 * torch.randn(32, 128, generator=g))
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e3])
def test_nvfp4_is_torchaos_bit_for_bit(dtype: torch.dtype, scale: float) -> None:
    nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    x = _data(dtype, scale)
    tensor_scale = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax().float())
    ref = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=tensor_scale).dequantize(torch.float32)
    assert torch.equal(fp4.nvfp4(x), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e3])
def test_mxfp4_is_torchaos_bit_for_bit(dtype: torch.dtype, scale: float) -> None:
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    x = _data(dtype, scale)
    ref = mx_tensor.MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, config.ScaleCalculationMode.RCEIL)
    assert torch.equal(fp4.mxfp4(x), ref.dequantize(torch.float32))


def test_nvfp4_weight_tiles_give_the_transpose_the_same_values() -> None:
    w = torch.randn(48, 80)
    assert torch.equal(fp4.nvfp4(w, tiles=True).t(), fp4.nvfp4(w.t().contiguous(), tiles=True))
    assert not torch.equal(fp4.nvfp4(w).t(), fp4.nvfp4(w.t().contiguous()))  # 1x16 blocks do not
    assert torch.equal(fp4.nvfp4(torch.zeros(4, 32)), torch.zeros(4, 32))


@pytest.mark.parametrize("policy", ["nvfp4", "mxfp4"])
def test_apply_and_remove_with_fp4(policy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.Linear(128, 10))
    x = torch.randn(4, 128)
    with torch.no_grad():
        before = model(x)
    weights = [p for p in model.parameters()]
    applied = castwise.apply(model, policy)
    out = model(x)
    assert not torch.equal(out.float(), before)  # the 4-bit rounding is there
    assert (out.float() - before).abs().max() < 0.5
    out.sum().backward()
    assert model[0].weight.grad is not None  # gradients pass straight through
    plan = applied.float8
    assert plan is not None and "0" in plan.converted and "3" not in plan.converted  # 10 outputs: left out
    applied.remove()
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert [p for p in model.parameters()] == weights
