"""CW141 narrowed-positions: positions rounded to 16-bit, then turned into rotary/sinusoidal phases."""

from __future__ import annotations

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._precision import (
    Narrowed,
    Rounding,
    chain_key,
    declared,
    fmt,
    modes_of,
    origin_of,
    records,
    short_op,
    where_from,
)
from castwise.rules.audit._text import generalize, where

META = Rule(
    code="CW141",
    name="narrowed-positions",
    category="LOWPREC_ROUNDING",
    severity="warning",
    summary="Positions or timesteps were rounded to 16-bit before their rotary/sinusoidal phases.",
    detects="Values carrying positions (position ids, an arange or cumsum, a timestep) made bf16/f16 "
    "where the 16-bit spacing is 2 or more (bf16 from 256, f16 from 2048): by an engine's input cast "
    "(`bf16-true`, FSDP2 `cast_forward_inputs`), a cast or `type_as` a 16-bit buffer in the model's "
    "code, or computed in 16-bit (a bf16 cumsum of a mask), then multiplied with a frequency table "
    "into the phases a sin, cos, exp or polar reads.",
    why="Nothing fails, but neighbouring positions share one 16-bit value (30000 and 30001 are one "
    "bf16 number, a 128-wide grid there), so the rotary phases and the timestep embedding are those "
    "of other positions. A frequency table (`inv_freq`) rounded to 16-bit while the phase is still "
    "computed in float32 from exact positions is not reported: its error is relative and the same "
    "for queries and keys.",
    example="A collator's float `position_ids` cast to bf16 by `bf16-true`; Megatron's "
    "`seq.type_as(inv_freq)` after a module cast; a diffusion timestep 999.4 cast to bf16 (1000).",
    fix="Keep the positions float32 or int64 up to the phase: `position_ids` as int64 (or kept out of "
    "the input cast), `.float()` on them before the outer product, and `type_as` only on the cos/sin "
    "result.",
)


def _scan(session: Session) -> list[Finding]:
    chains: dict[tuple[str, str], tuple[Narrowed, list[str]]] = {}
    for r, rec in records(session):
        for n in rec.narrowed:
            if declared(r, n.module, n.rounding.module, n.rounding.prov.module if n.rounding.prov else None):
                continue
            at = n.rounding.module if n.rounding.op else n.module
            _, modes = chains.setdefault(chain_key(at, n.rounding.prov), (n, []))
            if r.mode not in modes:
                modes.append(r.mode)
    return [_finding(n, modes) for n, modes in chains.values()]


def _finding(n: Narrowed, modes: list[str]) -> Finding:
    r = n.rounding
    low = short_of(r.dtype)
    step = r.step
    # computed in 16-bit (a bf16 cumsum): that op loses the positions; else the phase op reads them
    op, module = (r.op, r.module) if r.op else (n.op, n.module)
    how = f"computed in {low} by {short_op(r.op)} in {where(r.module)}" if r.op else f"made {low}"
    return Finding(
        code="CW141",
        module=module,
        op=op,
        origin=origin_of(r.prov),
        modes=modes_of(modes),
        message=(
            f"{where(n.module)} makes phases with {short_op(n.op)} (read by {short_op(n.reads)}) from positions "
            f"{how} ({where_from(r.prov, r.dtype)}){_scaled(r)}. Positions up to {fmt(r.largest)} are kept to steps of "
            f"{fmt(step)} in {low}: neighbouring positions share one value, so the phases are those of "
            f"other positions."
        ),
        fix=(
            "Keep the positions float32 or int64 up to the phase: keep them out of the input cast (int64 "
            "`position_ids`, a float32 timestep), `.float()` on them before the product with the "
            "frequencies, and `type_as` only on the cos/sin result."
        ),
        source=r.prov.source if r.prov is not None else None,
        details=(("magnitude", r.largest), ("step", step), ("reads", n.reads), ("fix_policy", _clause(r))),
    )


def _scaled(r: Rounding) -> str:
    """Where the positions were scaled after the rounding: by what, and from which size."""
    if r.scale == 1.0:
        return ""
    return f", then multiplied by {fmt(r.scale)} (rounded at up to {fmt(r.magnitude)})"


def _clause(r: Rounding) -> str:
    """The policy clause that keeps the positions wide: the input cast off where it narrowed an
    input, else the module that narrowed or computed them as a float32 island."""
    if r.prov is not None and r.prov.kind == "input":
        return "inputs=none"
    module = r.module if r.op else (r.prov.module if r.prov is not None and r.prov.module else r.module)
    return f"keep[{generalize(module)}]=f32" if module else "inputs=none"


RULE = AuditRule(META, scan=_scan)
