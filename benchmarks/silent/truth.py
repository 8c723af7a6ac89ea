"""Measured truth of a silent case: the model run in f32 against the recipe as it really runs
(real bf16 on this CPU), and the same gap for the case's counterpart (a planted case's fix, a
control's bug twin).

A recipe is one of
- ``true``: what ``bf16-true`` / FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16)`` / DeepSpeed
  bf16 do: every floating parameter and buffer cast to bf16 (``keep`` names left f32, as
  ``from_pretrained(dtype=bf16)`` keeps rotary tables), float inputs cast by the engine
  (``keep_inputs`` left f32), no autocast;
- ``mixed``: the f32 model under CPU bf16 autocast;
- ``none``: the model as written (its own code narrows).
``attrs`` set an attribute on every module that has it (``upcast=True``: the thread's fix).
The f32 reference runs the model as written with every ``low`` set to f32 and no recipe.

Gaps (f32 vs recipe): ``nll`` mean |delta| of per-token NLL over its mean magnitude (logprobs),
``loss`` relative, ``out`` relative L2 norm, ``experts`` the fraction of chosen experts that
differ, ``grad`` relative L2 norm of every parameter's gradient of the loss.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

BF16 = torch.bfloat16
# below this a gap is measurement noise: a counterpart that measures 0 is compared with this
FLOOR = {"nll": 1e-4, "loss": 1e-5, "out": 1e-4, "experts": 1e-3, "grad": 1e-4}
RATIO = 4.0  # a planted gap at least this many times its fix's; a control's at most 1/RATIO of its bug's


@dataclass(frozen=True)
class Recipe:
    kind: str = "true"  # "true" | "mixed" | "none"
    keep: tuple[str, ...] = ()
    keep_inputs: tuple[str, ...] = ()
    inputs_float: tuple[str, ...] = ()  # inputs made f32 first (a scheduler's float timesteps)
    attrs: tuple[tuple[str, Any], ...] = ()


REFERENCE = Recipe("none", attrs=(("low", torch.float32),))


@dataclass(frozen=True)
class Built:
    model: nn.Module
    inputs: dict[str, Any]


@dataclass(frozen=True)
class Gap:
    metric: str
    recipe: float  # the recipe against f32
    other: float  # the counterpart against f32
    extra: dict[str, float] = field(default_factory=dict)  # every other metric measured (recipe)

    def ratio(self) -> float:
        return self.recipe / max(self.other, FLOOR[self.metric])

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "recipe": self.recipe,
            "other": self.other,
            "ratio": self.ratio(),
            **{f"recipe_{k}": v for k, v in self.extra.items()},
        }


def _set_attrs(model: nn.Module, attrs: tuple[tuple[str, Any], ...]) -> None:
    for module in model.modules():
        for name, value in attrs:
            if name in vars(module):
                setattr(module, name, value)


def _kept(name: str, keep: tuple[str, ...]) -> bool:
    return any(name == k or name.startswith(k + ".") for k in keep)


def prepare(built: Built, recipe: Recipe) -> tuple[nn.Module, dict[str, Any]]:
    """A fresh copy of the model and inputs as ``recipe`` runs them."""
    model = copy.deepcopy(built.model)
    _set_attrs(model, recipe.attrs)
    inputs = dict(built.inputs)
    for key in recipe.inputs_float:
        inputs[key] = inputs[key].float()
    if recipe.kind != "true":
        return model, inputs
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and not _kept(name, recipe.keep):
                p.data = p.data.to(BF16)
        for name, b in list(model.named_buffers()):
            if b.is_floating_point() and not _kept(name, recipe.keep):
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = b.to(BF16)
    for key, value in inputs.items():  # the engine's input cast: float tensors only
        if isinstance(value, torch.Tensor) and value.is_floating_point() and key not in recipe.keep_inputs:
            inputs[key] = value.to(BF16)
    return model, inputs


@contextlib.contextmanager
def _context(recipe: Recipe) -> Iterator[None]:
    if recipe.kind == "mixed":
        with torch.autocast("cpu", dtype=BF16):
            yield
    else:
        yield


def run(built: Built, recipe: Recipe) -> dict[str, torch.Tensor]:
    """Forward (and backward of ``loss``) as ``recipe`` runs it; outputs and gradients in f64."""
    torch.manual_seed(0)
    model, inputs = prepare(built, recipe)
    model.train()
    with _context(recipe):
        out = model(**inputs)
    got = {k: v.detach().double() if v.is_floating_point() else v.detach() for k, v in out.items()}
    loss = out["loss"]
    if loss.requires_grad:
        loss.float().backward()
        grads = [p.grad.double().flatten() for p in model.parameters() if p.grad is not None]
        if grads:
            got["grad"] = torch.cat(grads)
    return got


def _gap(metric: str, ref: torch.Tensor, got: torch.Tensor) -> float:
    if metric == "experts":
        a, b = ref.sort(-1).values, got.sort(-1).values
        return float((a != b).double().mean())
    if metric == "nll":
        return float((got - ref).abs().mean() / ref.abs().mean().clamp_min(1e-30))
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def gaps(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for key in ("nll", "loss", "out", "experts", "grad"):
        if key in ref and key in got:
            out[key] = _gap(key, ref[key], got[key])
    return out


def measure(build: Callable[[], Built], metric: str, recipe: Recipe, other: Recipe) -> Gap:
    built = build()
    ref = run(built, REFERENCE)
    mine = gaps(ref, run(built, recipe))
    theirs = gaps(ref, run(built, other))
    return Gap(metric, mine[metric], theirs[metric], {k: v for k, v in mine.items() if k != metric})
