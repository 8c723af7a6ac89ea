"""compare's float8: a recipe emulated on a model's copy. The input and weight of every
``nn.Linear`` outside an island go through the recipe's forward format with ``scaling.scale``'s
scales along the reduction dim (torchao's own: per tensor, per row as a power of two, per MX block
of 32; NVFP4 and MXFP4 blocks: ``fp4``), ``nn.Conv*`` per tensor (torchao converts Linears only;
4-bit recipes leave them alone); the matmul runs in the base
compute dtype with its float32 accumulation, and gradients pass straight through."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from castwise.float8 import fp4, scaling
from castwise.policy.float8 import Float8Recipe

MATMUL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def cast_through(t: torch.Tensor, recipe: Float8Recipe, role: scaling.Role = "input") -> torch.Tensor:
    """``t`` rounded to ``role``'s float8 format with the recipe's scales (a 4-bit recipe: its
    E2M1 blocks, ``fp4``), in ``t``'s dtype; gradient straight through."""
    if recipe.fp4:
        return fp4.fake_quantize(t, recipe, weight=role == "weight")
    fmt = scaling.dtype(recipe, role)
    x = t.detach().float()
    s = scaling.scale(x, recipe, role)
    fmax = torch.finfo(fmt).max
    # the scaled value goes through the float8 format and back (saturated first, as torchao does):
    # that rounding is what is emulated
    q = (x * s).clamp(-fmax, fmax).to(fmt).float().div(s).to(t.dtype)
    return t + (q - t.detach()) if t.requires_grad else q


def linear_forward(recipe: Float8Recipe) -> Callable[..., Any]:
    def forward(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        weight = module._parameters["weight"]
        assert weight is not None  # Linear/Conv always have a weight
        # a Linear's weight is [out, in] and its input [..., in]: both reduce over the last dim
        w, xq = cast_through(weight, recipe, "weight"), cast_through(x, recipe)
        if isinstance(module, nn.Linear):
            return nn.functional.linear(xq, w, module.bias)
        conv: Any = module
        return conv._conv_forward(xq, w, conv.bias)

    return forward


def install(model: nn.Module, recipe: Float8Recipe, islands: Iterable[str]) -> None:
    """Emulate ``recipe`` in ``model``'s matmul modules outside ``islands``, in place."""
    kept = tuple(islands)
    per_tensor = Float8Recipe("tensorwise", None if recipe.fp4 else recipe.format)
    for name, module in model.named_modules():
        if not isinstance(module, MATMUL_MODULES) or "forward" in module.__dict__:
            continue
        if any(name == k or name.startswith(k + ".") or k == "" for k in kept):
            continue
        if recipe.fp4 and not isinstance(module, nn.Linear):
            continue  # 4-bit recipes quantize Linears only: a per-tensor 4-bit conv is no one's recipe
        own = recipe if isinstance(module, nn.Linear) else per_tensor
        module.forward = types.MethodType(linear_forward(own), module)  # type: ignore[method-assign]
        vars(module)["_castwise_float8"] = scaling.dtype(recipe)  # read by the tolerance: it rounds to float8
