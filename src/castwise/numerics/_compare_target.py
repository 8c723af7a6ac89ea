"""What compare and tune run: a policy, or a policy with emulated float8 matmuls; on copies.

A target is a castwise ``Policy`` (bf16/f16, mixed or true, with ``keep[...]`` islands), or an
emulated float8 format (``float8_e4m3fn``/``float8_e5m2``, spelt ``fp8``, ``e4m3``, ``e5m2``
too, optionally followed by policy clauses such as ``keep[*.wo]=f32``). float8 is emulated:
the model runs in float32, and the inputs and weights of every ``nn.Linear`` and ``nn.Conv*``
outside an island are cast through the float8 format with a per-tensor scale (amax mapped to
the format's largest finite value), as float8 training recipes scale them; the matmul itself
and its accumulation stay float32, and gradients pass straight through.
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

_FLOAT8 = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "f8e4m3fn": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "float8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "f8e5m2": torch.float8_e5m2,
    "e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
}
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

    policy: Policy
    float8: torch.dtype | None = None

    @property
    def low_dtype(self) -> torch.dtype:
        """The narrowest format the target computes in."""
        return self.float8 or self.policy.compute_dtype

    def with_islands(self, names: Iterable[str]) -> Target:
        rules = tuple(ModuleRule(_literal(n), torch.float32) for n in names)
        return Target(self.policy.with_rules(*rules), self.float8)

    def __str__(self) -> str:
        if self.float8 is None:
            return str(self.policy)
        rest = [str(r) for r in self.policy.rules]
        return ",".join([str(self.float8).removeprefix("torch."), *rest])


def _literal(name: str) -> str:
    """A glob that matches exactly one qualified module name (no wildcard in it)."""
    if any(ch in name for ch in "*?[]"):
        return "re:" + name.replace(".", r"\.")
    return name


def parse_target(policy: Policy | str | Target) -> Target:
    if isinstance(policy, Target):
        return policy
    if isinstance(policy, Policy):
        return Target(policy)
    if not isinstance(policy, str):
        raise PolicyError(
            f"policy must be a castwise.Policy or a policy string, got {type(policy).__name__}; compare and "
            "tune need the policy to measure, e.g. policy='bf16-mixed' (CLI: --policy bf16-mixed), or an "
            "emulated float8 format: float8_e4m3fn, float8_e5m2"
        )
    head, _, rest = policy.partition(",")
    fmt = _FLOAT8.get(head.strip().lower())
    if fmt is None:
        return Target(Policy.parse(policy))
    base = Policy.parse("32-true" + ("," + rest if rest.strip() else ""))
    return Target(base, fmt)


# -- float8 emulation ----------------------------------------------------------------------


def _cast_through(t: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``fmt`` with a per-tensor scale, in ``t``'s dtype; gradient straight through."""
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    scale = torch.finfo(fmt).max / amax
    # the scaled value goes through the float8 format and back: that rounding is what is emulated
    q = (t.detach().float() * scale).to(fmt).float().div(scale).to(t.dtype)
    return t + (q - t.detach()) if t.requires_grad else q


def _float8_forward(fmt: torch.dtype) -> Callable[..., Any]:
    def forward(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        weight = module._parameters["weight"]
        assert weight is not None  # Linear/Conv always have a weight
        w = _cast_through(weight, fmt)
        xq = _cast_through(x, fmt)
        if isinstance(module, nn.Linear):
            return nn.functional.linear(xq, w, module.bias)
        conv: Any = module
        return conv._conv_forward(xq, w, conv.bias)

    return forward


def _install_float8(model: nn.Module, fmt: torch.dtype, islands: Iterable[str]) -> None:
    kept = tuple(islands)
    for name, module in model.named_modules():
        if not isinstance(module, _MATMUL_MODULES) or "forward" in module.__dict__:
            continue
        if any(name == k or name.startswith(k + ".") or k == "" for k in kept):
            continue
        module.forward = types.MethodType(_float8_forward(fmt), module)  # type: ignore[method-assign]
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
        _install_float8(twin, target.float8, applied.islands)
    twin.train(mode == "train")
    _no_dropout(twin)
    return twin
