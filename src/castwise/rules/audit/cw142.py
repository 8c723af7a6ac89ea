"""CW142 low-precision-decision: top-k, argmax, sort or a comparison on 16-bit probabilities."""

from __future__ import annotations

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._precision import (
    LOGITS,
    Decision,
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
    code="CW142",
    name="low-precision-decision",
    category="LOWPREC_ROUNDING",
    severity="warning",
    summary="A choice (top-k, argmax, sort) is taken on 16-bit probabilities or router logits.",
    detects="top-k, argmax, sort or a comparison on the bf16/f16 output of a softmax or sigmoid "
    "(an MoE router), or on scores to which a 16-bit buffer (an expert bias) was added; and top-k "
    "on the bf16/f16 logits a gate's matmul made (litgpt's router: top-k first, softmax of the k).",
    why="Nothing fails, but probabilities near 1/experts are kept to a few significant bits: "
    "experts closer than the 16-bit spacing tie or swap, so tokens go to other experts than the "
    "float32 router would choose, and the load balance and the loss drift.",
    example="A Mixtral-style router under `bf16-true`: softmax(gate(x)) in bf16, then topk.",
    fix="Run the router in float32: `keep[<router>]=f32`, or `.float()` on the router logits before "
    "the softmax (and keep expert-bias buffers float32).",
)


def _scan(session: Session) -> list[Finding]:
    chains: dict[tuple[str, str], tuple[Decision, list[str]]] = {}
    for r, rec in records(session):
        for d in rec.decisions:
            if declared(r, d.module):
                continue
            _, modes = chains.setdefault((generalize(d.module), d.made_by), (d, []))
            if r.mode not in modes:
                modes.append(r.mode)
    return [_finding(d, modes) for d, modes in chains.values()]


def _finding(d: Decision, modes: list[str]) -> Finding:
    low = short_of(d.dtype)
    logits = d.made_by == LOGITS
    # a probability among `width` choices; logits of a router are about 1 (measured: mean |logit|
    # 0.46 for bf16 gates at init, the spacing of 0.25-0.5 to 1-2 in bf16)
    typical = 1.0 if logits else 1.0 / max(d.width, 1)
    step = spacing(typical, d.dtype)
    router = generalize(d.module) or "MODULE"
    if logits:
        near = f"Logits near {fmt(typical)}"
        fix = (
            f"Run the router in float32: `keep[{router}]=f32` (its gate's matmul makes the logits: a "
            "`.float()` after it keeps them rounded)."
        )
    else:
        near = f"Probabilities near 1/{d.width} = {fmt(typical)}"
        fix = (
            f"Run the router in float32: `keep[{router}]=f32`, or `.float()` on its logits before the "
            f"{d.made_by}; keep an expert-bias buffer float32."
        )
    return Finding(
        code="CW142",
        module=d.module,
        op=d.op,
        origin=origin_of(d.prov),
        modes=modes_of(modes),
        message=(
            f"{where(d.module)} takes {short_op(d.op)} over {d.width} choices on {low} values made by "
            f"{d.made_by} ({where_from(d.prov, d.dtype)}). {near} "
            f"are kept to steps of {fmt(step)} in {low}: choices closer than that tie or swap."
        ),
        fix=fix,
        source=d.prov.source if d.prov is not None else None,
        details=(("width", d.width), ("step", step), ("made_by", d.made_by), ("fix_policy", f"keep[{router}]=f32")),
    )


RULE = AuditRule(META, scan=_scan)
