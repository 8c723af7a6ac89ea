"""What compare and tune run: a policy, with its float8 GEMMs emulated; on copies.

A target is any precision string ``Policy.parse`` reads (one vocabulary for every surface): a
policy (bf16/f16, mixed or true, with ``keep[...]`` islands), or one with a float8 recipe
(``fp8``, ``mxfp8``, ``transformer-engine``, ``--bf16 --fp8-format hybrid``, or a float8 format
alone: ``float8_e4m3fn``/``e4m3``/``e5m2``, float8 GEMMs over float32). The base policy is
applied; float8 is emulated on top: the inputs and weights of every ``nn.Linear`` and
``nn.Conv*`` outside an island are cast through the recipe's forward format with its scales
(amax mapped to the format's largest finite value: per tensor for tensorwise and delayed
scaling, per row for rowwise, per block of 32 / 128 along the reduction dim, as a power of two
for mxfp8, for mxfp8 / blockwise); the matmul itself runs in the base compute dtype with its
float32 accumulation, and gradients pass straight through.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise.applied import apply
from castwise.errors import PolicyError
from castwise.policy import ModuleRule, Policy
from castwise.policy.float8 import Float8Recipe

# unit roundoff (half the distance from 1 to the next number) of each format
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float8_e4m3fn: 2.0**-4,
    torch.float8_e5m2: 2.0**-3,
}
_MATMUL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class Target:
    """A policy to compare or tune, with an emulated float8 format or none."""

    policy: Policy  # the base policy apply runs (no float8 recipe: that part is emulated here)
    float8: torch.dtype | None = None  # the recipe's forward format
    recipe: Float8Recipe | None = None

    @property
    def low_dtype(self) -> torch.dtype:
        """The narrowest format the target computes in."""
        return self.float8 or self.policy.compute_dtype

    def with_islands(self, names: Iterable[str]) -> Target:
        rules = tuple(ModuleRule(_literal(n), torch.float32) for n in names)
        return Target(self.policy.with_rules(*rules), self.float8, self.recipe)

    @property
    def full_policy(self) -> Policy:
        """The policy with its float8 recipe: what the user asked for."""
        return self.policy.replace(float8=self.recipe)

    def __str__(self) -> str:
        return str(self.full_policy)


def _literal(name: str) -> str:
    """A glob that matches exactly one qualified module name (no wildcard in it)."""
    if any(ch in name for ch in "*?[]"):
        return "re:" + name.replace(".", r"\.")
    return name


def parse_target(policy: Policy | str | int | Target) -> Target:
    if isinstance(policy, Target):
        return policy
    if not isinstance(policy, (Policy, str, int)) or isinstance(policy, bool):
        raise PolicyError(
            f"policy must be a castwise.Policy or a policy string, got {type(policy).__name__}; compare and "
            "tune need the policy to measure, e.g. policy='bf16-mixed' (CLI: --policy bf16-mixed), or one with "
            "float8 GEMMs: fp8, mxfp8, float8_e4m3fn, float8_e5m2"
        )
    full = Policy.parse(policy)
    if full.float8 is None:
        return Target(full)
    recipe = full.float8
    return Target(full.replace(float8=None), getattr(torch, recipe.forward_dtype), recipe)


# -- float8 emulation ----------------------------------------------------------------------


def _amax(x: torch.Tensor, recipe: Float8Recipe | None) -> torch.Tensor:
    """The amax each element is scaled by: per tensor, per row, or per block along the last dim
    (the reduction dim of a Linear's input and weight), broadcast back to ``x``'s shape."""
    a = x.abs()
    if recipe is None or recipe.scaling in ("tensorwise", "delayed") or x.dim() < 2:
        return a.amax()
    if recipe.block is None:  # rowwise
        return a.amax(dim=-1, keepdim=True)
    n = x.shape[-1]
    pad = (-n) % recipe.block
    padded = nn.functional.pad(a, (0, pad))
    blocks = padded.reshape(*padded.shape[:-1], -1, recipe.block).amax(dim=-1, keepdim=True)
    out: torch.Tensor = blocks.expand(*blocks.shape[:-1], recipe.block).flatten(-2)[..., :n]
    return out


def _cast_through(t: torch.Tensor, fmt: torch.dtype, recipe: Float8Recipe | None = None) -> torch.Tensor:
    """``t`` rounded to ``fmt`` with the recipe's scales, in ``t``'s dtype; gradient straight through."""
    amax = _amax(t.detach().float(), recipe).clamp(min=1e-12)
    scale = torch.finfo(fmt).max / amax
    if recipe is not None and recipe.scaling == "mxfp8":
        scale = torch.exp2(torch.floor(torch.log2(scale)))  # MX scales are powers of two (e8m0)
    # the scaled value goes through the float8 format and back: that rounding is what is emulated
    q = (t.detach().float() * scale).to(fmt).float().div(scale).to(t.dtype)
    return t + (q - t.detach()) if t.requires_grad else q


def _float8_forward(fmt: torch.dtype, recipe: Float8Recipe | None) -> Callable[..., Any]:
    def forward(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        weight = module._parameters["weight"]
        assert weight is not None  # Linear/Conv always have a weight
        # a Linear's weight is [out, in] and its input [..., in]: both reduce over the last dim
        w = _cast_through(weight, fmt, recipe if isinstance(module, nn.Linear) else None)
        xq = _cast_through(x, fmt, recipe if isinstance(module, nn.Linear) else None)
        if isinstance(module, nn.Linear):
            return nn.functional.linear(xq, w, module.bias)
        conv: Any = module
        return conv._conv_forward(xq, w, conv.bias)

    return forward


def _install_float8(
    model: nn.Module, fmt: torch.dtype, islands: Iterable[str], recipe: Float8Recipe | None = None
) -> None:
    kept = tuple(islands)
    for name, module in model.named_modules():
        if not isinstance(module, _MATMUL_MODULES) or "forward" in module.__dict__:
            continue
        if any(name == k or name.startswith(k + ".") or k == "" for k in kept):
            continue
        module.forward = types.MethodType(_float8_forward(fmt, recipe), module)  # type: ignore[method-assign]
        vars(module)["_castwise_float8"] = fmt  # read by the tolerance: this module rounds to float8


# -- copies --------------------------------------------------------------------------------


def _no_dropout(model: nn.Module) -> None:
    """Dropout masks are noise, not precision: compared copies run without them."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float) and not isinstance(value, bool):
                setattr(module, key, 0.0)


def prepared(model: nn.Module, target: Target, mode: str) -> nn.Module:
    """A deep copy of ``model`` under ``target``, in ``mode``, without dropout."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    applied = apply(twin, target.policy)
    if target.float8 is not None:
        _install_float8(twin, target.float8, applied.islands, target.recipe)
    twin.train(mode == "train")
    _no_dropout(twin)
    return twin
