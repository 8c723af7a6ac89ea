"""CW154: the dtypes an optimizer step mixes, raised for real (imports torch).

torch's Adam family makes its state in the parameter's dtype (torch/optim/adam.py ``_init_group``:
``torch.zeros_like(p, memory_format=torch.preserve_format)``) and then mixes it with the gradient
(``exp_avg.lerp_(grad, 1 - beta1)``), which refuses two dtypes: bf16 weights with
``param.grad_dtype = torch.float32`` crash at the first ``optimizer.step()``. Rather than read such
rules from each optimizer's source, the step is run: the user's optimizer class and each param
group's settings over a small sample of its parameters, in their dtypes, with gradients of the
run's gradient dtypes. A group whose step raises is reported with the dtypes it mixed, where the
gradient's dtype came from, the state the step made before it raised, and each fix run on the same
sample for a few steps (works / fails): f32 master weights, gradients in the parameter's dtype,
``foreach=False``, ``fused=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise._dtypes import name_of, short_of
from castwise.ledger.model import OptimizerSpec
from castwise.ledger.values import FIELDS, UNKNOWN, Entry, Ledger, group_rows, listed
from castwise.rules.api import Finding

__all__ = ["FIXES", "Fix", "contract_findings", "mixes_dtypes", "raised_ledger"]

_ELEMENTS = 256  # of each parameter the sample steps on (whole rows, one at least)
_STEPS = 3  # a fix counts as working when this many steps run and keep the weights finite


@dataclass(frozen=True)
class Fix:
    """A change to the step, tried on the sample: the weights' and gradients' dtypes (None: as
    they are) and settings added to the param group."""

    name: str
    weights: torch.dtype | None = None
    grads: str = "as run"  # "as run" | "param": the gradient in the parameter's dtype
    settings: tuple[tuple[str, Any], ...] = ()


FIXES = (
    Fix("f32 master weights (f32 parameters, the forward under bf16/f16 autocast)", torch.float32, "param"),
    Fix("gradients in the parameter's dtype (grad_dtype unset)", None, "param"),
    Fix("foreach=False", settings=(("foreach", False),)),
    Fix("fused=True", settings=(("fused", True),)),
)


def mixes_dtypes(params: Mapping[str, torch.Tensor], grad_dtypes: Mapping[str, torch.dtype]) -> bool:
    """Whether a step would meet a gradient of another dtype than its parameter."""
    return any(grad_dtypes.get(n, p.dtype) != p.dtype for n, p in params.items() if p.is_floating_point())


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    if p.dim() == 0 or p.numel() <= _ELEMENTS:
        return tuple(p.shape)
    per_row = max(1, p.numel() // p.shape[0])
    return (max(1, _ELEMENTS // per_row), *p.shape[1:])


def _run(
    spec: OptimizerSpec,
    group: int,
    params: Mapping[str, torch.Tensor],
    grad_dtypes: Mapping[str, torch.dtype],
    fix: Fix | None,
) -> tuple[str | None, torch.optim.Optimizer | None, dict[str, nn.Parameter]]:
    """Steps of param group ``group`` on a CPU sample: (what torch raised or None, the optimizer,
    the sample)."""
    names, kw = spec.groups[group]
    gen = torch.Generator().manual_seed(0)
    sample: dict[str, nn.Parameter] = {}
    grads: dict[str, torch.Tensor] = {}
    for n in names:
        p = params.get(n)
        if p is None or not p.is_floating_point():
            continue
        dtype = fix.weights if fix is not None and fix.weights is not None else p.dtype
        values = torch.randn(_shape(p), generator=gen) * 0.02
        sample[n] = nn.Parameter(values.to(dtype))
        gdt = dtype if fix is not None and fix.grads == "param" else grad_dtypes.get(n, p.dtype)
        if gdt != dtype:
            sample[n].grad_dtype = gdt  # (torch refuses a .grad of another dtype without it)
        grads[n] = (torch.randn(_shape(p), generator=gen) * 1e-3).to(gdt)
    if not sample:
        return None, None, sample
    settings = {**kw, **dict(fix.settings if fix is not None else ())}
    try:
        opt = spec.cls([{"params": list(sample.values()), **settings}])
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}", None, sample
    try:
        with torch.no_grad():
            for _ in range(1 if fix is None else _STEPS):
                for n, q in sample.items():
                    q.grad = grads[n].clone()
                opt.step()
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}", opt, sample
    if not all(bool(torch.isfinite(q).all()) for q in sample.values()):
        return "the weights went NaN/Inf", opt, sample
    return None, opt, sample


def _made(opt: torch.optim.Optimizer | None, sample: Mapping[str, nn.Parameter]) -> str:
    """The per-element state the step made before it raised: "exp_avg, exp_avg_sq bf16"."""
    if opt is None:
        return ""
    by_dtype: dict[str, list[str]] = {}
    for q in sample.values():
        for k, v in opt.state.get(q, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == q.shape and k not in by_dtype.get(short_of(v.dtype), []):
                by_dtype.setdefault(short_of(v.dtype), []).append(k)
        break  # one parameter says what the group makes
    return "; ".join(f"{', '.join(ks)} {dt}" for dt, ks in by_dtype.items())


def _grad_origin(p: torch.Tensor, dtype: torch.dtype, declared: torch.dtype | None) -> str:
    set_on = declared if declared is not None else getattr(p, "grad_dtype", None)
    if isinstance(set_on, torch.dtype) and set_on == dtype and set_on != p.dtype:
        return f"param.grad_dtype = torch.{str(dtype).removeprefix('torch.')}"
    return "the gradient as the run made it (cast by a hook or wrapper, or set by the script)"


def contract_findings(
    spec: OptimizerSpec,
    params: Mapping[str, torch.Tensor],
    grad_dtypes: Mapping[str, torch.dtype],
    declared: Mapping[str, torch.dtype] | None = None,
) -> list[Finding]:
    """CW154 for the param groups whose step raises on the dtypes of ``params`` (by name; a meta
    tensor gives its dtype and shape) and their gradients (``grad_dtypes``, else the parameter's);
    ``declared``: the user's ``grad_dtype`` settings, where ``params`` are a copy without them."""
    opt_name = spec.name.rsplit(".", 1)[-1]
    failing: list[tuple[int, str, str]] = []
    for g in range(len(spec.groups)):
        raised, opt, sample = _run(spec, g, params, grad_dtypes, None)
        if raised is not None and opt is not None:  # (a group its constructor refuses is no dtype contract)
            failing.append((g, raised, _made(opt, sample)))
    if not failing:
        return []
    parts = []
    for g, raised, made in failing:
        names = [n for n in spec.groups[g][0] if n in params and params[n].is_floating_point()]
        mixed = [n for n in names if grad_dtypes.get(n, params[n].dtype) != params[n].dtype] or names
        n0 = mixed[0]
        p0, gdt = params[n0], grad_dtypes.get(n0, params[n0].dtype)
        lr = spec.groups[g][1].get("lr")
        shown = listed(mixed, 4)
        origin = _grad_origin(p0, gdt, (declared or {}).get(n0))
        parts.append(
            f"param group {g}{f' (lr={lr:g})' if isinstance(lr, float | int) else ''}: {shown}: "
            f"{short_of(p0.dtype)} weights, {short_of(gdt)} gradients ({origin})"
            + (f", state made {made}" if made else "")
            + f"; torch raised {raised}"
        )
    verdicts = []
    works = []
    for fix in FIXES:
        ok = all(_run(spec, g, params, grad_dtypes, fix)[0] is None for g, _, _ in failing)
        verdicts.append(f"{fix.name}: {'works' if ok else 'fails'}")
        if ok:
            works.append(fix.name)
    return [
        Finding(
            code="CW154",
            message=f"the {opt_name} step raises on the dtypes it mixes: {'; '.join(parts)}. The optimizer makes "
            "its state in the parameter's dtype and combines it with a gradient of another dtype in one op.",
            fix=f"Checked on a sample of the group, {_STEPS} real steps each: {'; '.join(verdicts)}."
            + (f" Use {works[0]}." if works else " Use an optimizer that takes gradients of another dtype."),
            details=(
                ("groups", tuple(g for g, _, _ in failing)),
                ("params", tuple(n for g, _, _ in failing for n in spec.groups[g][0] if n in params)),
                ("fixes_verified", tuple(works)),
            ),
        )
    ]


def raised_ledger(
    spec: OptimizerSpec,
    params: Mapping[str, torch.Tensor],
    grad_dtypes: Mapping[str, torch.dtype],
    source: str,
    findings: list[Finding],
) -> Ledger:
    """The ledger of a step that raised (CW154): storage and gradient as they are; what the step
    would have made, unknown."""
    why = "unknown: the step raised (CW154)"
    per = []
    for names, _ in spec.groups:
        for n in names:
            p = params.get(n)
            if p is None:
                continue
            gdt = grad_dtypes.get(n, p.dtype)
            entries = {k: Entry(UNKNOWN, "", why) for k in FIELDS}
            entries["storage"] = Entry(name_of(p.dtype), "parameter dtype")
            entries["gradient"] = Entry(name_of(gdt), "param.grad (grad_dtype)")
            per.append((n, entries))
    return Ledger(group_rows(per), f"{source} with {spec.name}", findings=tuple(findings))
