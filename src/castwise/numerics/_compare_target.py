"""What compare and tune run: a policy, with its float8 GEMMs emulated; on copies.

A target is any precision string ``Policy.parse`` reads (one vocabulary for every surface): a
policy (bf16/f16, mixed or true, with ``keep[...]`` islands), or one with a float8 recipe
(``fp8``, ``mxfp8``, ``transformer-engine``, ``--bf16 --fp8-format hybrid``, or a float8 format
alone: ``float8_e4m3fn``/``e4m3``/``e5m2``, float8 GEMMs over float32). The base policy is
applied; float8 is emulated on top (``castwise.float8.emulate``: torchao's scales, the matmul in
the base compute dtype).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from castwise.applied import apply
from castwise.errors import PolicyError
from castwise.float8 import emulate, scaling
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


@dataclass(frozen=True)
class Target:
    """A policy to compare or tune, with an emulated float8 format or none."""

    policy: Policy  # the base policy apply runs (no float8 recipe: that part is emulated here)
    recipe: Float8Recipe | None = None

    @property
    def float8(self) -> torch.dtype | None:
        """The recipe's forward format, which the emulated matmuls round to."""
        return None if self.recipe is None else scaling.dtype(self.recipe)

    def with_islands(self, names: Iterable[str]) -> Target:
        rules = tuple(ModuleRule(_literal(n), torch.float32) for n in names)
        return Target(self.policy.with_rules(*rules), self.recipe)

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
    return Target(full.replace(float8=None), full.float8)


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
    if target.recipe is not None:
        emulate.install(twin, target.recipe, applied.islands)
    twin.train(mode == "train")
    _no_dropout(twin)
    _no_cache(twin)
    return twin


def _no_cache(model: nn.Module) -> None:
    """The copy keeps no key/value cache (transformers' ``config.use_cache``): a cache is state each
    attention call appends to, so the call run alone on its recorded inputs would find the whole
    run's keys in it (and the reference's dtype: GPT-2's attention cannot run alone then). Both
    sides run without one, so the numbers compared are the same computation."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            setattr(config, "use_cache", False)  # noqa: B010 (any config object: not a typed attribute)
