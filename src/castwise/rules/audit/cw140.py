"""CW140 f32-op-in-low-precision: a loss or log-softmax autocast runs in f32 ran in 16-bit."""

from __future__ import annotations

from typing import Any

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Finding, FixContext, Origin, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._precision import (
    LowOp,
    chain_key,
    declared,
    fmt,
    modes_of,
    origin_of,
    records,
    short_op,
    spacing,
    where_from,
)
from castwise.rules.audit._text import generalize, where

META = Rule(
    code="CW140",
    name="f32-op-in-low-precision",
    category="LOWPREC_ROUNDING",
    severity="warning",
    summary="A loss or log-softmax that autocast runs in float32 ran in 16-bit.",
    detects="An op the target device's autocast runs in float32 (cross-entropy's log_softmax and "
    "nll_loss, logsumexp, the regression losses; the list is torch's own autocast policy for the "
    "device) ran with bf16/f16 inputs and no autocast, because an engine or policy cast the "
    "parameters (`bf16-true`, `16-true`, FSDP2 `param_dtype`, DeepSpeed bf16, `hf:bfloat16`).",
    why="Nothing fails, but the loss and the log-probabilities are rounded to the 16-bit spacing at "
    "their magnitude: at |log p| ~ ln(vocabulary) = 10 bf16 keeps steps of 0.0625, so log-prob "
    "ratios (RL), perplexity and the loss curve are noisy and the gradient is too. Ops whose kernel "
    "computes in float32 and rounds once (softmax, layer_norm, sum) are not reported.",
    example="A Llama trained with `bf16-true` (or FSDP2 `MixedPrecisionPolicy(param_dtype=bf16)`): "
    "cross-entropy on bf16 logits.",
    fix="Give the loss float32 logits: `out[lm_head]=f32` (the module making the logits), or "
    "`logits.float()` before the loss, as autocast and torchtitan do.",
)


def _scan(session: Session) -> list[Finding]:
    # one finding per origin chain (log_softmax then nll_loss on the same logits is one)
    chains: dict[tuple[str, str], tuple[list[LowOp], list[str]]] = {}
    # the root's own ops run inside the policy's autocast (entered after the root's frame)
    mixed = session.policy is not None and session.policy.is_mixed
    for r, rec in records(session):
        for low in rec.low_ops:
            # a clause on the op's module or on the one that made its 16-bit input declares it
            maker = low.made_by or (low.prov.module if low.prov is not None else None)
            if (mixed and not low.module) or declared(r, low.module, maker):
                continue
            ops, modes = chains.setdefault(chain_key(low.module, low.prov), ([], []))
            if all(short_op(o.op) != short_op(low.op) for o in ops):
                ops.append(low)
            if r.mode not in modes:
                modes.append(r.mode)
    return [_finding(ops, modes, session) for ops, modes in chains.values()]


def _finding(ops: list[LowOp], modes: list[str], session: Session) -> Finding:
    first = ops[0]
    low = short_of(first.dtype)
    names = ", ".join(short_op(o.op) for o in ops)
    # cross-entropy passes its own dtype to log_softmax, so autocast runs only its nll_loss in
    # float32 (aten/src/ATen/native/LossNLL.cpp, cross_entropy_loss: log_softmax(self, dim,
    # self.scalar_type())): claim no more than that
    claimed = [o for o in ops if not (short_op(o.op) == "log_softmax" and len(ops) > 1)]
    said = ", ".join(short_op(o.op) for o in claimed)
    if len(claimed) < len(ops):
        names = f"cross-entropy ({names})"
    mag = max(o.magnitude for o in ops)
    # one 16-bit spacing at the typical size: more than half of one, as the CPU kernel and the
    # composite paths round their intermediates too (measured in tests/rules/audit/test_cw14x.py)
    err = spacing(mag, first.dtype)
    dev = next((r.device.name for r in session.runs if r.device is not None), "the target")
    maker = _maker(first)
    # the model returns what it computed at its top level, and a `*-true` policy casts it down again
    back = " with `output=f32` (the model returns the loss)" if not first.module else ""
    return Finding(
        code="CW140",
        module=first.module,
        op=claimed[0].op,
        origin=_origin(first),
        modes=modes_of(modes),
        message=(
            f"{where(first.module)} runs {names} on {low}{list(first.shape)} without autocast "
            f"({where_from(first.prov, first.dtype)}); {dev}'s autocast runs {said} in float32. "
            f"The results, about {fmt(mag)} in size, are rounded to {low}: about {fmt(err)} off each "
            f"(the {low} spacing there), where float32 would keep them to 1e-6."
        ),
        fix=(
            f"Give {names} float32 inputs: `out[{maker}]=f32` (the module making them){back}, or "
            f"`.float()` on them before the loss in code, as autocast does."
        ),
        source=first.prov.source if first.prov is not None else None,
        details=(
            ("ops", [o.op for o in ops]),
            ("estimated_error", err),
            ("magnitude", mag),
            # the clause verify_fixes runs (none where no module made the logits)
            *((("fix_policy", f"out[{maker}]=f32" + (",output=f32" if back else "")),) if maker != "MODULE" else ()),
        ),
    )


def _origin(low: LowOp) -> Origin | None:
    # the module that computed the 16-bit values (the head for a loss's logits), where the fix
    # goes; the dtype's provenance (the first 16-bit weight upstream) where no other module did
    if low.made_by and low.made_by != low.module:
        return Origin(low.made_by, None, f"its output {short_of(low.dtype)}{list(low.shape)}")
    return origin_of(low.prov)


def _maker(low: LowOp) -> str:
    if low.made_by and low.made_by != low.module:
        return generalize(low.made_by)
    prov = low.prov
    if prov is not None and prov.module:
        return generalize(prov.module)
    return generalize(low.module) or "MODULE"


def _policy_fix(policy: Any, finding: Finding, ctx: FixContext) -> Any:
    import torch

    if finding.origin is not None and finding.origin.module:
        ctx.add(generalize(finding.origin.module), torch.float32, "out")
    return policy


RULE = AuditRule(META, scan=_scan, policy_fix=_policy_fix)
