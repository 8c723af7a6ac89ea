"""Error measures, and the error one module adds when run alone on the reference's inputs.

A module's *added* error: the module, as the policy's copy has it (its dtypes, its island,
the autocast state it was called under), run on the reference run's inputs (cast to the
dtypes the policy's run had there), with every module it calls answering with the
reference's output for that call. What differs from the reference's output is then made by
the module's own ops alone, not inherited from its inputs nor added by its children, less
the error of casting its inputs (an identity module passes that on and adds nothing).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise import _autocast
from castwise.numerics._compare_run import Call, cast_like, float_tensors
from castwise.numerics._compare_target import UNIT_ROUNDOFF
from castwise.run import map_tensors


@dataclass(frozen=True)
class Err:
    """A relative L2 error, kept as its parts so errors of several calls can be pooled."""

    num: float  # sum of squared differences
    den: float  # sum of squared reference values
    nonfinite: bool = False  # the policy's value is inf/nan where the reference's is finite

    def __add__(self, other: Err) -> Err:
        return Err(self.num + other.num, self.den + other.den, self.nonfinite or other.nonfinite)

    @property
    def value(self) -> float:
        if self.nonfinite:
            return math.inf
        if self.den > 0:
            return math.sqrt(self.num / self.den)
        return 0.0 if self.num == 0 else math.inf


NO_ERR = Err(0.0, 0.0)


def _wide(t: torch.Tensor) -> torch.Tensor:
    # float32 holds the difference of two bf16/f16/f32 values well enough for a relative error
    return t.detach() if t.dtype == torch.float64 else t.detach().float()


def tensor_err(low: torch.Tensor, ref: torch.Tensor) -> Err:
    if low.shape != ref.shape or not ref.is_floating_point():
        return NO_ERR
    a, b = _wide(low), _wide(ref)
    if a.dtype != b.dtype:
        a = a.to(b.dtype)  # float64 only when the reference is float64
    # fused norms: one pass each, no temporary for the difference
    num = float(torch.dist(a, b)) ** 2
    den = float(torch.linalg.vector_norm(b)) ** 2
    if math.isfinite(num) and math.isfinite(den):
        return Err(num, den)
    finite = torch.isfinite(b)  # the slow path: non-finite values somewhere
    a, b = a[finite], b[finite]
    num = float((a - b).pow(2).sum())
    den = float(b.pow(2).sum())
    return Err(num, den) if math.isfinite(num) else Err(0.0, den, True)


def err(low: Any, ref: Any) -> Err:
    total = NO_ERR
    for a, b in zip(float_tensors(low), float_tensors(ref), strict=False):
        total = total + tensor_err(a, b)
    return total


def grad_err(low: list[torch.Tensor | None], ref: list[torch.Tensor | None]) -> Err:
    total = NO_ERR
    for a, b in zip(low, ref, strict=False):
        if a is not None and b is not None:
            total = total + tensor_err(a, b)
    return total


def sensitivity(iso: Any, ref: Call) -> float:
    """AutoQuantize's score: sum((added output error * the reference's output gradient)^2), a
    second-order estimate of how much the loss moves; without gradients, the squared error."""
    total = 0.0
    for i, (a, b) in enumerate(zip(float_tensors(iso), float_tensors(ref.out), strict=False)):
        if a.shape != b.shape:
            continue
        delta = _wide(a) - _wide(b)
        g = ref.grads[i] if i < len(ref.grads) else None
        score = float(torch.linalg.vector_norm(delta * g if g is not None else delta)) ** 2
        if not math.isfinite(score):
            if bool(torch.isfinite(delta[torch.isfinite(b)]).all()):
                continue  # the reference itself is not finite there: nothing to score
            return math.inf
        total += score
    return total


def unit_roundoff(call: Call, callees: list[Call]) -> float:
    """The unit roundoff of the narrowest format this call computed in under the policy: its
    inputs, outputs, own parameters, autocast, emulated float8, and what its callees returned."""
    dtypes = {t.dtype for t in float_tensors((call.args, call.kwargs, call.out, [c.out for c in callees]))}
    dtypes |= {p.dtype for p in call.module.parameters(recurse=False) if p.is_floating_point()}
    for device in _autocast.DEVICE_TYPES:
        auto = call.autocast.enabled_for(device)
        if auto is not None:
            dtypes.add(auto)
    emulated = getattr(call.module, "_castwise_float8", None)
    if emulated is not None:
        dtypes.add(emulated)
    return max((UNIT_ROUNDOFF.get(d, 0.0) for d in dtypes), default=UNIT_ROUNDOFF[torch.float32])


def _replay(queue: deque[Any], fallback: Any) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if queue:
            return map_tensors(queue.popleft(), lambda t: t.clone())  # the module may write in place
        return fallback(*args, **kwargs)

    return forward


def isolated(low: Call, ref: Call, children: list[tuple[Call, Call]]) -> tuple[Any, Err]:
    """Run ``low.module`` alone on ``ref``'s inputs; its callees replay the reference's outputs.
    Returns the output and the error of the inputs' cast to the policy's dtypes (rounding,
    saturation): what even an exact module would pass on."""
    args = map_tensors(cast_like(ref.args, low.args), lambda t: t.clone())
    kwargs = map_tensors(cast_like(ref.kwargs, low.kwargs), lambda t: t.clone())
    rounding = err((args, kwargs), (ref.args, ref.kwargs))
    queues: dict[int, deque[Any]] = {}
    modules: dict[int, nn.Module] = {}
    for low_child, ref_child in children:
        key = id(low_child.module)
        queues.setdefault(key, deque()).append(cast_like(ref_child.out, low_child.out))
        modules[key] = low_child.module
    saved: dict[int, tuple[bool, Any]] = {}
    before = _autocast.AutocastState.capture()
    try:
        for key, module in modules.items():
            saved[key] = ("forward" in module.__dict__, module.__dict__.get("forward"))
            module.forward = _replay(queues[key], module.forward)  # type: ignore[method-assign]
        low.autocast.restore()
        with torch.no_grad():
            out = low.module(*args, **kwargs) if isinstance(args, tuple) else low.module(args, **kwargs)
        return out, rounding
    finally:
        before.restore()
        for key, (had, previous) in saved.items():
            if had:
                modules[key].forward = previous  # type: ignore[method-assign]
            else:
                modules[key].__dict__.pop("forward", None)
