"""The ledger's run rules, measured on the model's copy (imports torch).

CW150: a bf16/f16 parameter whose optimizer steps round away: against the same steps taken in
float32 (same optimizer class and settings, same gradients, an f32 twin of the weights and state),
the stored weights miss most of the movement: ``missed_share``, the norm of the f32 movement the
stored weights fall short of over the norm of the f32 movement, the measure the runtime benchmark's
20-step truth uses. Norm-weighted, since a parameter whose large elements move trains even when its tiny-update
elements round away (f16 SGD at lr 1.0: 56% of one weight's changing elements stay put on the
first step, yet it misses 16% of the f32 movement after 20 steps). The audit measures one step;
``castwise run`` the script's first ``STALL_STEPS`` steps. Measured on synthetic gradients only
for optimizers whose step does not scale with the gradient (Adam-like: the same step for
gradients 100x larger).
CW151: a state whose dtype a resume changes: ``optimizer.load_state_dict(optimizer.state_dict())``
on a fresh optimizer (torch's ``Optimizer.load_state_dict`` casts floating state to the
parameter's dtype) gives another dtype than the step made.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from castwise._dtypes import short_of
from castwise.ledger.contracts import contract_findings, raised_ledger
from castwise.ledger.model import (
    OptimizerSpec,
    StepResult,
    _grad_dtype,
    _state_tensors,
    keeps_precision,
    ledger_of,
    step_copy,
)
from castwise.ledger.values import Ledger, listed
from castwise.rules.api import Finding

__all__ = [
    "F32Twin",
    "cw150",
    "f32_step",
    "kept_rows",
    "ledger_with_findings",
    "missed_share",
    "resume_findings",
    "step_findings",
    "update_findings",
]

# report a parameter whose stored weights miss more than half the f32 movement: the runtime
# benchmark's truth calls a parameter stalled at the same share after 20 steps
_STALL = 0.5
_SHOWN = 6


class F32Twin:
    """The steps of an optimizer in float32: the optimizer (class, groups' settings) over f32
    copies of the weights ``before`` its first step and, where given, the state it held then
    (``states``: per parameter, its per-element tensors), stepped with the gradients it is given."""

    def __init__(
        self,
        spec: OptimizerSpec,
        before: Mapping[str, torch.Tensor],
        states: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.params = {n: nn.Parameter(t.detach().float().clone()) for n, t in before.items()}
        self.opt = spec.build_on(self.params)
        for n, st in (states or {}).items():
            if n in self.params and st:  # (an optimizer that makes its state at construction: Adagrad)
                p = self.params[n]
                self.opt.state[p] = {
                    k: v.float().clone() if isinstance(v, torch.Tensor) and v.shape == p.shape else copy.deepcopy(v)
                    for k, v in st.items()
                }

    def step(self, grads: Mapping[str, torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]:
        """One step with ``grads`` (times ``scale``; a parameter without one does not step)."""
        for n, p in self.params.items():
            g = grads.get(n)
            p.grad = g.detach().float() * scale if g is not None else None
        with torch.no_grad():
            self.opt.step()
        return {n: p.detach() for n, p in self.params.items()}


def f32_step(
    spec: OptimizerSpec,
    before: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    scale: float = 1.0,
    states: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, torch.Tensor]:
    """One step of ``F32Twin`` over the parameters in ``grads``."""
    return F32Twin(spec, {n: before[n] for n in grads}, states).step(grads, scale)


def step_findings(
    spec: OptimizerSpec,
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    keep: frozenset[str] = frozenset(),
) -> list[Finding]:
    """CW153 (the steps made NaN/Inf the same steps in f32 do not) and CW150 (the stored weights
    ``after`` the steps miss most of the f32 twin's movement ``ref``; not for ``keep``: rows keeping
    precision by design)."""
    lost: list[tuple[str, float]] = []
    broken: list[tuple[str, float]] = []
    for n, r in ref.items():
        new = ~torch.isfinite(after[n]) & torch.isfinite(before[n]) & torch.isfinite(r)
        if bool(new.any()):
            broken.append((n, float(new.float().mean())))
            continue
        frac = missed_share(before[n], after[n], r) if n not in keep else None
        if frac is not None and frac > _STALL:
            lost.append((n, frac))
    out = []
    if broken:
        dt = short_of(after[broken[0][0]].dtype)
        out.append(
            Finding(
                code="CW153",
                message=f"one {spec.name.rsplit('.', 1)[-1]} step made NaN/Inf in {dt} weights the same step in "
                f"f32 keeps finite: {_group_text(spec, broken)} (share of elements made non-finite). A state or "
                f"term of the step does not fit {dt}: squared gradients or eps flush to zero, and the update "
                "divides by it.",
                fix="Keep f32 master weights and optimizer state (f32 parameters under autocast), or an "
                "optimizer that keeps its state in f32 for 16-bit weights; for Adam in f16, eps >= 1e-4 only "
                "hides it.",
                details=(("params", tuple(n for n, _ in broken)),),
            )
        )
    if lost:
        out.append(cw150(spec, lost, after[lost[0][0]].dtype, None))
    return out


def missed_share(before: torch.Tensor, after: torch.Tensor, ref: torch.Tensor) -> float | None:
    """The share of the f32 movement ``ref - before`` the stored weights ``after`` fall short of, in
    norm: per element, the part of the f32 move not covered by a move the same way (an element that
    moves further than in f32 misses nothing: rounding up is not a stall). None: f32 moves nothing."""
    start = before.float()
    want = ref - start
    size = want.abs()
    moved = float(size.norm())
    if moved == 0.0:
        return None
    along = (after.float() - start) * want.sign()
    short = size - torch.minimum(along.clamp(min=0.0), size)
    return float(short.norm()) / moved


def _group_text(spec: OptimizerSpec, lost: list[tuple[str, float]]) -> str:
    """The lost parameters by param group: "param group 1 (lr=1e-05): a.weight (97%), ..."."""
    by_group: dict[int | None, list[str]] = {}
    for n, frac in lost:
        by_group.setdefault(spec.group_of(n), []).append(f"{n} ({frac:.0%})")
    parts = []
    for g, names in by_group.items():
        shown = listed(names, _SHOWN)
        if g is None:
            parts.append(shown)
            continue
        lr = spec.groups[g][1].get("lr")
        parts.append(f"param group {g}{f' (lr={lr:g})' if isinstance(lr, float | int) else ''}: {shown}")
    return "; ".join(parts)


def cw150(spec: OptimizerSpec, lost: list[tuple[str, float]], dtype: torch.dtype, module: str | None) -> Finding:
    """CW150 for the parameters in ``lost`` (name, share of the f32 movement missed)."""
    dt = short_of(dtype)
    opt = spec.name.rsplit(".", 1)[-1]
    return Finding(
        code="CW150",
        module=module,
        message=f"{opt} steps leave {len(lost)} {dt} parameters behind the same steps in f32: "
        f"{_group_text(spec, lost)} (share of the f32 movement the stored weights miss). The update is below "
        f"the spacing of {dt} at these weights and rounds away.",
        fix="Keep f32 master weights (f32 parameters under bf16 autocast; DeepSpeed/Megatron's f32 main params, "
        "not bf16_master_weights), or an optimizer with bf16 stochastic rounding (torchao AdamW/AdamW8bit "
        "bf16_stochastic_round=True) or Kahan summation; re-run to check the parameters move.",
        details=(
            ("params", tuple(n for n, _ in lost)),
            ("groups", tuple(sorted({spec.group_of(n) or 0 for n, _ in lost}))),
        ),
    )


def update_findings(
    model: nn.Module,
    spec: OptimizerSpec,
    result: StepResult,
    *,
    measured: bool = False,
    keep: frozenset[str] = frozenset(),
) -> list[Finding]:
    """CW150 / CW153 of one step. ``measured``: the gradients are a run's own; else synthetic, and only
    an optimizer whose step does not scale with them (Adam-like) says anything. ``keep``: the
    parameters whose row keeps precision by design (master copy, stochastic rounding, Kahan)."""
    low = {
        n: p
        for n, p in result.model.named_parameters()
        if p.dtype in (torch.bfloat16, torch.float16) and n in result.before
    }
    if not low or any(p.device.type == "meta" for p in low.values()):
        return []  # no values on the meta device: nothing to measure
    grads = {n: p.grad.detach().clone() for n, p in low.items() if p.grad is not None}
    ref = f32_step(spec, result.before, grads, 1.0)
    if not measured:
        big = f32_step(spec, result.before, grads, 100.0)
        for n in grads:
            before = result.before[n].float()
            d1, d100 = (ref[n] - before).abs(), (big[n] - before).abs()
            moved = d1 > 0
            if bool(moved.any()) and not 0.5 <= float(d100[moved].median() / d1[moved].median()) <= 2.0:
                return []  # the step scales with the gradient: synthetic gradients say nothing
    after = {n: low[n].detach() for n in grads}
    return step_findings(spec, result.before, after, ref, keep)


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
    shown = listed(changed, 6)
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


def kept_rows(ledger: Ledger) -> frozenset[str]:
    """The parameters of rows that keep precision by design (not CW150's)."""
    return frozenset(n for r in ledger.rows if keeps_precision(r.entries()) for n in r.params)


def ledger_with_findings(model: nn.Module, spec: OptimizerSpec, source: str = "model") -> Ledger:
    """The model's ledger with CW150 / CW151 measured on the same step."""
    try:
        result = step_copy(model, spec)
    except (RuntimeError, TypeError):
        params = dict(model.named_parameters())
        grads = {n: _grad_dtype(p) for n, p in params.items()}
        contract = contract_findings(spec, params, grads)
        if not contract:
            raise
        return raised_ledger(spec, params, grads, source, contract)
    ledger = ledger_of(result, spec, source)
    found = (*update_findings(model, spec, result, keep=kept_rows(ledger)), *resume_findings(result))
    return dataclasses.replace(ledger, findings=found)
