"""compare's float8 emulation against torchao's own float8 layers run on the CPU."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from castwise.float8 import emulate
from castwise.float8.convert import mx_drops_bias
from castwise.policy.float8 import Float8Recipe


def _layer_and_rows() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-2, 2, 32).unsqueeze(1))  # weight rows of very different sizes
    # REVIEW.md's repro: token rows of 1, 3, 0.07 and 300
    x = torch.randn(8, 64) * torch.tensor([1.0, 3.0, 0.07, 300.0] * 2).unsqueeze(1)
    return layer, x


def _emulated(layer: nn.Linear, recipe: Float8Recipe, x: torch.Tensor) -> torch.Tensor:
    twin = copy.deepcopy(layer)
    emulate.install(twin, recipe, ())
    with torch.no_grad():
        out: torch.Tensor = twin(x)
    return out


def _before(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """compare's rowwise emulation before the one scaling model: max / amax, no power of two."""
    f8 = torch.float8_e4m3fn

    def cast(t: torch.Tensor) -> torch.Tensor:
        s = torch.finfo(f8).max / t.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        return (t * s).to(f8).float() / s

    with torch.no_grad():
        return nn.functional.linear(cast(x), cast(layer.weight), layer.bias)


def test_rowwise_emulation_is_torchaos_float8linear_forward() -> None:
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    layer, x = _layer_and_rows()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    with torch.no_grad():
        real = Float8Linear.from_float(copy.deepcopy(layer), config=config)(x)
        exact = layer(x)
    ours, before = _emulated(layer, Float8Recipe("rowwise"), x), _before(layer, x)
    assert (ours - real).norm() <= 1e-5 * real.norm()  # the same float8 values: only the sum order differs
    assert (before - real).norm() > 100 * (ours - real).norm()
    # compare's error for the recipe is the error of the recipe users run
    err_real, err_ours, err_before = ((o - exact).norm() / exact.norm() for o in (real, ours, before))
    assert abs(err_ours - err_real) <= 1e-3 * err_real < abs(err_before - err_real)


@pytest.mark.parametrize("scaling", ["tensorwise", "mxfp8"])
def test_tensorwise_and_mx_emulation_are_torchaos_forward(scaling: str) -> None:
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    layer, x = _layer_and_rows()
    if scaling == "tensorwise":
        real_layer = Float8Linear.from_float(copy.deepcopy(layer), config=Float8LinearConfig(emulate=True))
    else:
        holder = nn.Sequential(copy.deepcopy(layer))
        quantize_(holder, MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED))
        real_layer = holder[0]
    with torch.no_grad():
        real = real_layer(x)
    if scaling == "mxfp8" and mx_drops_bias():
        real = real + layer.bias  # torchao 0.18's MX training linear drops the bias
    ours = _emulated(layer, Float8Recipe(scaling), x)  # type: ignore[arg-type]
    assert (ours - real).norm() <= 1e-5 * real.norm()
