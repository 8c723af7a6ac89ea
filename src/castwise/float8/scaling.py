"""The one float8 scaling model: the scale a recipe multiplies a tensor by before its float8 cast,
torchao's own, along the last dim (the GEMM's reduction dim: callers put it there). tensorwise
(delayed: from the current amax) and rowwise: ``max / max(amax, EPS)`` in float64, per tensor or
row (``torchao.float8.float8_utils.tensor_to_scale``), rowwise's rounded down to a power of two (its
recipe's ``round_scales_to_power_of_2=True``); blockwise per 1x128 block; mxfp8 an E8M0 power of
two per block of 32, rounded up (RCEIL: ``MXFP8TrainingOpConfig``, ``mx_tensor._to_mx_rceil``).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from torch import nn

from castwise.policy.float8 import MX_BLOCK, Float8Recipe, Scaling

__all__ = ["EPS", "MX_BLOCK", "RECIPES", "amax", "dtype", "multiple", "mx_scale", "recipe_in", "scale"]

EPS = 1e-12  # torchao.float8.float8_utils.EPS: the amax floor of per-tensor and per-row scales
# the recipes torchao trains: apply converts them, forecast scores every operand under each
RECIPES: tuple[Scaling, ...] = ("tensorwise", "rowwise", "mxfp8")
Role = Literal["input", "weight", "grad_output"]
_E8M0_BIAS = 127
NVFP4_MULTIPLE = 128


def dtype(recipe: Float8Recipe, role: Role = "input") -> torch.dtype:
    """The float8 dtype ``role`` is cast to: the gradient's format for grad_output."""
    name = recipe.gradient_dtype if role == "grad_output" else recipe.forward_dtype
    got: torch.dtype = getattr(torch, name)
    return got


def recipe_in(scaling: str, dtype_name: str) -> Float8Recipe:
    """``scaling`` with every operand in the float8 format ``dtype_name``."""
    return Float8Recipe(cast(Scaling, scaling), "e5m2" if "e5m2" in dtype_name else "e4m3")


def multiple(recipe: Float8Recipe) -> int:
    """What every GEMM dimension must be a multiple of: 16 (``_scaled_mm``), the block for MX,
    128 for NVFP4 (torchao's NVFP4 training GEMM: "M, K, N all divisible by 128")."""
    return {"mxfp8": MX_BLOCK, "mxfp4": MX_BLOCK, "nvfp4": NVFP4_MULTIPLE}.get(recipe.scaling, 16)


def amax(x: torch.Tensor, recipe: Float8Recipe) -> torch.Tensor:
    """The absmax each element of ``x`` is scaled by (per tensor, row or block along the last dim),
    broadcastable to ``x``; in ``x``'s dtype, NaN where a NaN is (torch.amax's own)."""
    a = x.detach().abs()
    if recipe.scaling in ("tensorwise", "delayed") or a.dim() == 0:
        return a.amax()
    block = recipe.block
    if block is None:
        return a.amax(dim=-1, keepdim=True)
    n = a.shape[-1]
    padded = nn.functional.pad(a, (0, (-n) % block))
    blocks = padded.reshape(*padded.shape[:-1], -1, block).amax(dim=-1, keepdim=True)
    out: torch.Tensor = blocks.expand(*blocks.shape[:-1], block).flatten(-2)[..., :n]
    return out


def scale(x: torch.Tensor, recipe: Float8Recipe, role: Role = "input") -> torch.Tensor:
    """The float32 scale of each element of ``x`` (broadcastable to it) under ``recipe``:
    ``x * scale``, clamped to the format's largest and cast, is the float8 value torchao makes."""
    fmax = torch.finfo(dtype(recipe, role)).max
    a = amax(x, recipe).float()
    if recipe.scaling == "mxfp8":
        return mx_scale(a, fmax)
    # float64 as torchao's amax_to_scale (compiled and eager agree there); MPS has no float64
    s = (fmax / (a if a.device.type == "mps" else a.double()).clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if recipe.scaling == "rowwise" else s


def mx_scale(a: torch.Tensor, fmax: float) -> torch.Tensor:
    """torchao's RCEIL E8M0 scale of blocks with absmax ``a``, the eager path of ``_to_mx_rceil``:
    2^-ceil(log2(amax / max)) within E8M0's exponents; 1 for an all-zero block (torchao's own
    choice), 2^-127 for an Inf, NaN for a NaN."""
    descale = a / fmax
    exp = torch.ceil(torch.log2(descale)).clamp(min=-_E8M0_BIAS, max=_E8M0_BIAS)
    s = torch.where(exp == -_E8M0_BIAS, torch.ones_like(a), torch.exp2(-exp))
    s = torch.where(torch.isinf(descale), torch.full_like(a, 2.0**-_E8M0_BIAS), s)
    return torch.where(torch.isnan(descale), descale, s)
