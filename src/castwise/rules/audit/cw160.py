"""CW160 mixed-width-into-kernel: an op without a dtype contract takes f32 beside bf16/f16 activations."""

from __future__ import annotations

from typing import Any

from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Origin, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._text import generalize, where

META = Rule(
    code="CW160",
    name="mixed-width-into-kernel",
    category="UNCAST_CUSTOM_OP_OR_EXTENSION",
    severity="warning",
    summary="An op castwise has no contract for takes float32 beside bf16/f16 activations.",
    detects="A custom or extension op (outside torch, without an entry in the contract table) "
    "receives floating activations of different widths on the simulated device: float32 q/k "
    "beside a bf16 v, typically from a norm autocast runs in float32.",
    why="External kernels (flash-attn, SageAttention, xFormers and most hand-written ones) take "
    "one 16-bit dtype: on the GPU they refuse the mix, while the fake run has no check to fail.",
    example="QK-RMSNorm under CUDA autocast (torch >= 2.12 runs rms_norm in float32) feeding a custom attention op.",
    fix="Cast the float32 operand back where it is made (`q = self.norm_q(q).to(v.dtype)`), or "
    "keep the norm's output in its input dtype.",
)

# norms autocast runs in float32 on CUDA; rms_norm joined the list in torch 2.12 (issue 36)
_AUTOCAST_F32_NORMS = ("rms_norm", "layer_norm", "group_norm", "batch_norm")


def _scan(session: Session) -> list[Finding]:
    # one finding per op and origin, repeated blocks counted once
    seen: dict[tuple[str, str | None], tuple[dict[str, Any], list[str]]] = {}
    for r in session.runs:
        if any(ev.phase == "forward" for ev in r.trace.events):
            continue  # the run is refused anyway: the error speaks for it
        fail = r.trace.failure
        for rec in r.trace.observed.get("mixed_width", ()):
            if fail is not None and fail.op == rec["op"] and fail.module == rec["module"]:
                continue  # the op itself refused the mix: its error speaks for it
            odd = rec["odd"][0]
            key = (rec["op"], generalize(odd["origin"].module) if odd["origin"] and odd["origin"].module else None)
            entry = seen.setdefault(key, (rec, []))
            if r.mode not in entry[1]:
                entry[1].append(r.mode)
    return [_finding(rec, modes) for rec, modes in seen.values()]


def _finding(rec: dict[str, Any], modes: list[str]) -> Finding:
    odd = rec["odd"][0]
    narrow = {"bfloat16": "bf16", "float16": "f16"}.get(rec["narrow"], rec["narrow"])
    wide = {"float32": "f32", "float64": "f64"}.get(odd["dtype"], odd["dtype"])
    origin: Origin | None = odd["origin"]
    made = odd["describe"] or "an unknown origin"
    why_f32 = ""
    norm = next((n for n in _AUTOCAST_F32_NORMS if odd["op"] and n in odd["op"]), None)
    if odd["kind"] == "autocast" and norm:
        why_f32 = f" (autocast runs {norm} in float32 on this device and torch release)"
    message = (
        f"{where(rec['module'])} passes {wide} beside {narrow} activations to {rec['op']}, an op castwise has no "
        f"dtype contract for: its {wide} operand is {made}{why_f32}. Kernels of this kind (flash-attn, "
        f"SageAttention, xFormers) take one 16-bit dtype and refuse the mix on the GPU."
    )
    at = f"after `{origin.module}`" if origin and origin.module else "before the op"
    fix = (
        f"Cast the {wide} operand back to {narrow} {at} (`q = q.to(v.dtype)`), or keep the "
        f"{norm or 'op'}'s output in its input dtype."
    )
    return Finding(
        code="CW160",
        module=rec["module"],
        op=rec["op"],
        origin=origin,
        modes=tuple(m for m in ("train", "eval") if m in modes),
        message=message,
        fix=fix,
        source=odd["source"],
        details=(("dtypes", list(rec["dtypes"])),),
    )


RULE = AuditRule(META, scan=_scan)
