"""The ledger's run rules, measured on the model's copy (imports torch).

CW150: a bf16/f16 parameter whose optimizer step rounds away: the same step taken in float32
(same optimizer class and settings, same gradients) changes the weight, the stored one does not.
Measured only for optimizers whose step does not scale with the gradient (Adam-like: the same
step for gradients 100x larger), since the gradients here are synthetic.
CW151: a state whose dtype a resume changes: ``optimizer.load_state_dict(optimizer.state_dict())``
on a fresh optimizer (torch's ``Optimizer.load_state_dict`` casts floating state to the
parameter's dtype) gives another dtype than the step made.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from castwise._dtypes import short_of
from castwise.ledger.model import OptimizerSpec, StepResult, _state_tensors, ledger_from_model
from castwise.ledger.values import Ledger
from castwise.rules.api import Finding

__all__ = ["ledger_with_findings", "resume_findings", "update_findings"]

_LOST = 0.5  # report a group when most of its changing elements do not change in storage


def _f32_step(
    model: nn.Module, spec: OptimizerSpec, grads: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    twin = copy.deepcopy(model).float()
    opt = spec.build(twin)
    params = dict(twin.named_parameters())
    for n, g in grads.items():
        params[n].grad = g.float() * scale
    opt.step()
    return {n: params[n].detach() for n in grads}


def update_findings(model: nn.Module, spec: OptimizerSpec, result: StepResult) -> list[Finding]:
    low = {
        n: p
        for n, p in result.model.named_parameters()
        if p.dtype in (torch.bfloat16, torch.float16) and n in result.before
    }
    if not low or any(p.device.type == "meta" for p in low.values()):
        return []  # no values on the meta device: nothing to measure
    grads = {n: p.grad.detach().clone() for n, p in low.items() if p.grad is not None}
    ref = _f32_step(model, spec, grads, 1.0)
    big = _f32_step(model, spec, grads, 100.0)
    lost: list[tuple[str, float]] = []
    for n, p in low.items():
        before = result.before[n].float()
        d1, d100 = (ref[n] - before).abs(), (big[n] - before).abs()
        moved = d1 > 0
        if not bool(moved.any()):
            continue
        ratio = float(d100[moved].median() / d1[moved].median())
        if not 0.5 <= ratio <= 2.0:
            return []  # the step scales with the gradient: synthetic gradients say nothing
        stuck = moved & (p.detach() == result.before[n])
        frac = float(stuck.sum() / moved.sum())
        if frac >= _LOST:
            lost.append((n, frac))
    if not lost:
        return []
    names = ", ".join(f"{n} ({frac:.0%})" for n, frac in lost[:6]) + (
        f" (+{len(lost) - 6} more)" if len(lost) > 6 else ""
    )
    dt = short_of(low[lost[0][0]].dtype)
    return [
        Finding(
            code="CW150",
            message=f"one {spec.name.rsplit('.', 1)[-1]} step leaves most elements of {len(lost)} {dt} parameters "
            f"unchanged that the same step in f32 changes: {names} (share of changing elements lost). The update "
            f"is below the spacing of {dt} at these weights and rounds away.",
            fix="Keep f32 master weights (train f32 parameters under autocast), or an optimizer with bf16 "
            "stochastic rounding (torchao AdamW8bit/AdamW4bit/AdamWFp8 bf16_stochastic_round=True) or Kahan "
            "summation; re-run castwise ledger to check the parameters move.",
        )
    ]


def resume_findings(result: StepResult) -> list[Finding]:
    if result.resumed is None:
        return []
    names = {id(p): n for n, p in result.model.named_parameters()}
    changed: list[str] = []
    resumed_params = [q for g in result.resumed.param_groups for q in g["params"]]
    original_params = [p for g in result.optimizer.param_groups for p in g["params"]]
    for p, q in zip(original_params, resumed_params, strict=True):
        before = _state_tensors(result.optimizer.state.get(p, {}), p)
        after = _state_tensors(result.resumed.state.get(q, {}), q)
        for key, t in before.items():
            u = after.get(key)
            if u is not None and u.dtype != t.dtype:
                changed.append(f"{names.get(id(p), '?')}.{key} {short_of(t.dtype)} -> {short_of(u.dtype)}")
    if not changed:
        return []
    shown = ", ".join(changed[:6]) + (f" (+{len(changed) - 6} more)" if len(changed) > 6 else "")
    return [
        Finding(
            code="CW151",
            message=f"a resume changes the precision of optimizer state: {shown}. torch's "
            "Optimizer.load_state_dict casts floating state to its parameter's dtype, so a state kept wider "
            "than its parameter comes back narrower (or the reverse).",
            fix="Keep the state's dtype across a resume: override the optimizer's load_state_dict (or "
            "_process_value_according_to_param_policy) to keep the saved dtype, or re-cast the state after loading.",
        )
    ]


def ledger_with_findings(model: nn.Module, spec: OptimizerSpec, source: str = "model") -> Ledger:
    """The model's ledger with CW150 / CW151 measured on the same step."""
    ledger, result = ledger_from_model(model, spec, source)
    found = (*update_findings(model, spec, result), *resume_findings(result))
    return dataclasses.replace(ledger, findings=found)
