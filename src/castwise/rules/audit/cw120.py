"""CW120 silent-fp32-upcast: Activations silently became float32 in a low-precision region."""

from __future__ import annotations

from typing import Any

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._precision import NAME, PrecisionRecord
from castwise.rules.audit._text import (
    generalize,
    is_ancestor,
    true_preset,
    where,
)

META = Rule(
    code="CW120",
    name="silent-fp32-upcast",
    category="KEEP_FP32_MODULE_LEAK",
    severity="warning",
    summary="Activations silently became float32 in a low-precision region.",
    detects="In a model meant to compute in bf16/fp16, a module's output is float32 where "
    "its input was low precision, and the float32 spreads to later modules (not where it only "
    "feeds a loss, a softmax, a norm or a reduction: `logits.float()` before cross-entropy).",
    why="Nothing fails, but the model runs (part of) its activations in float32: more "
    "memory and slower, while the user believes it runs in half precision.",
    example="T5 in float16 without a strict norm: the residual stream is f32 from block 0.",
    fix="Cast the float32 output back at the module that makes it (an fp32 island with "
    "cast-back: the `*-true` presets do it).",
)


def _scan(session: Session) -> list[Finding]:
    # silent float32 up-casts outside autocast, one finding per origin
    seen: dict[tuple[str | None, str], tuple[Any, list[str]]] = {}
    for r in session.runs:
        failed = [ev.module for ev in r.trace.events if ev.phase == "forward"]
        if r.trace.failure is not None:
            failed.append(r.trace.failure.module)
        quiet = _contained(r.trace.observed.get(NAME))
        for u in r.trace.upcasts:
            if u.module in quiet:
                continue  # its float32 feeds only a loss, softmax, norm or reduction (logits.float() before CE)
            if any(is_ancestor(u.module, m) and (m or not u.module) for m in failed):
                continue  # it did not return float32: it raised (or the real kernel would have)
            # one finding per origin, repeated blocks (blocks.0.wo, blocks.1.wo...) counted as one
            key = (generalize(u.prov.module) if u.prov else None, generalize(u.module) if u.prov is None else "")
            entry = seen.setdefault(key, (u, []))
            if r.mode not in entry[1]:
                entry[1].append(r.mode)
    act = _activation_share(session)
    out: list[Finding] = []
    for u, modes in seen.values():
        src = u.prov.describe() if u.prov else "an op in it"
        low = short_of(u.in_dtype)
        island = generalize(u.prov.module if u.prov and u.prov.module else u.module)
        out.append(
            Finding(
                code="CW120",
                module=u.module,
                op=u.prov.op if u.prov else None,
                origin=u.prov.origin() if u.prov else None,
                modes=tuple(m for m in ("train", "eval") if m in modes),
                message=(
                    f"{where(u.module)} takes {low} activations and returns float32 ({src}); later modules then "
                    f"run in float32 while the model is meant to compute in {low}.{act}"
                ),
                fix=(
                    f"Cast the float32 back to {low} where it is made: a float32 island with cast-back "
                    f"(`keep[{island}]=f32`; `{true_preset(u.in_dtype)}` does it for _keep_in_fp32_modules and "
                    "norms)."
                ),
            )
        )
    return out


def _contained(record: object) -> frozenset[str]:
    # up-casts whose float32 the precision observer saw end in a loss, softmax, norm or reduction
    # and never reach a matmul or the 16-bit stream: the float32 is the point there, not a leak
    if not isinstance(record, PrecisionRecord):
        return frozenset()
    return record.contained - record.spread


def _activation_share(session: Session) -> str:
    total = dict(session.runs[0].trace.activation_bytes) if session.runs else {}
    all_bytes = sum(total.values())
    if not all_bytes or "float32" not in total:
        return ""
    return f" float32 holds {100 * total['float32'] / all_bytes:.0f}% of activation bytes."


RULE = AuditRule(META, scan=_scan)
