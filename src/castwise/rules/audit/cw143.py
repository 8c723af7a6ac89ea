"""CW143 low-precision-accumulation: a 16-bit tensor accumulated into over many contributions."""

from __future__ import annotations

from typing import Any

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Finding, FixContext, Origin, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._precision import (
    MIN_CONTRIBUTIONS,
    Accumulation,
    PrecisionRecord,
    accumulated_error,
    fmt,
    modes_of,
    origin_of,
    records,
    short_op,
    stall_count,
    where_from,
)
from castwise.rules.audit._text import generalize, where

META = Rule(
    code="CW143",
    name="low-precision-accumulation",
    category="LOWPREC_ROUNDING",
    severity="warning",
    summary="A bf16/f16 tensor is accumulated into over many contributions.",
    detects=f"A 16-bit accumulator added into {MIN_CONTRIBUTIONS} or more times: a python loop "
    "`acc = acc + x` / `acc += x` in one module (a chunked norm, a scan's running state), "
    "`index_add_` / `scatter_add_` / `index_put_(accumulate=True)` with that many contributions "
    "per slot where the device's kernel adds into the 16-bit element (counts, histograms), or a "
    "`cumsum` on a device whose kernel adds in 16-bit (CUDA). "
    "`sum`, `mean`, softmax and the norms are not reported: their kernels accumulate in float32; "
    "nor are a residual stream (each block's add is its own), a compensated (Kahan) loop or a "
    "float32 accumulator.",
    why="Nothing fails, but every add rounds the running sum to the 16-bit spacing at its size, and "
    "once the sum is 2^(bits+1) times an addend (bf16: 256) the addend is lost: a bf16 count of "
    "ones stops at 256, a sum of 1024 squares ends near a quarter of its value.",
    example="RMSNorm ported from a kernel: `acc = acc + part.pow(2).sum(-1)` over 512 chunks in bf16; "
    "expert usage counts taken with `index_add_` of bf16 ones.",
    fix="Accumulate in float32 and round once: a float32 accumulator (`torch.zeros(..., "
    "dtype=torch.float32)`, `.float()` on the addends), `torch.sum` over a stacked axis, "
    "`cumsum(dtype=torch.float32)`, integer counts (`torch.bincount`); or run the module as a "
    "float32 island: `keep[<module>]=f32`.",
)


def _scan(session: Session) -> list[Finding]:
    chains: dict[tuple[str, str, str | None], tuple[Accumulation, list[str]]] = {}
    for r, rec in records(session):
        for acc in rec.accumulations:
            if _counted_positions(acc, rec):
                continue
            key = (acc.op, generalize(acc.module), acc.line)
            got, modes = chains.setdefault(key, (acc, []))
            if acc.count > got.count:
                chains[key] = (acc, modes)
            if r.mode not in modes:
                modes.append(r.mode)
    return [_finding(acc, modes) for acc, modes in chains.values()]


def _counted_positions(acc: Accumulation, rec: PrecisionRecord) -> bool:
    """A 16-bit cumsum making positions that CW141 reports already (the same op, one finding)."""
    return any(n.rounding.op == acc.op and n.rounding.module == acc.module for n in rec.narrowed)


def _finding(acc: Accumulation, modes: list[str]) -> Finding:
    low = short_of(acc.dtype)
    err, worst = accumulated_error(acc.count, acc.dtype)
    module = generalize(acc.module) or "MODULE"
    what = {
        "add": f"adds {acc.count} contributions in a loop into",
        "sub": f"adds {acc.count} contributions in a loop into",
        "cumsum": f"scans {acc.count} values with cumsum, whose kernel adds in {low} on this device, into",
    }.get(
        short_op(acc.op),
        f"adds {'' if acc.known else 'about '}{acc.count} contributions per slot with {short_op(acc.op)} into",
    )
    line = f" at {acc.line}" if acc.line else ""
    return Finding(
        code="CW143",
        module=acc.module,
        op=acc.op,
        origin=_origin(acc),
        modes=modes_of(modes),
        message=(
            f"{where(acc.module)} {what} a {low}{list(acc.shape)} accumulator{line} "
            f"({where_from(acc.prov, acc.dtype)}). Each add rounds the running sum to {low}, and from "
            f"{stall_count(acc.dtype)} addends on one of the mean size is lost: the sum ends about "
            f"{fmt(100 * err)}% off (up to {fmt(100 * worst)}% for equal addends, a count), where a float32 "
            "accumulator rounded once keeps it to one spacing."
        ),
        fix=(
            f"Accumulate in float32 and cast back once: {_code_fix(acc)}; or run `{module}` as a float32 "
            f"island: `keep[{module}]=f32`."
        ),
        source=acc.line or (acc.prov.source if acc.prov is not None else None),
        details=(("count", acc.count), ("estimated_error", err), ("worst_error", worst), ("known_count", acc.known)),
    )


def _code_fix(acc: Accumulation) -> str:
    op = short_op(acc.op)
    if op == "cumsum":
        return "`torch.cumsum(x, dim, dtype=torch.float32)`"
    if op in ("add", "sub"):
        return "a float32 accumulator (`torch.zeros(..., dtype=torch.float32)`, or `.float()` before the loop)"
    return f"{op} into a float32 tensor (`torch.zeros(..., dtype=torch.float32)`; counts as integers: `torch.bincount`)"


def _origin(acc: Accumulation) -> Origin | None:
    # made 16-bit in a module (a zeros(dtype=x.dtype), a cast): that line is where the fix goes;
    # an accumulator that took its dtype from the stream (zeros_like of bf16 activations) started
    # where the accumulation runs
    prov = acc.prov
    if prov is not None and prov.module and prov.kind in ("created", "cast", "op"):
        return origin_of(prov)
    return Origin(acc.module, acc.op, f"the {short_of(acc.dtype)}{list(acc.shape)} accumulator")


def _policy_fix(policy: Any, finding: Finding, ctx: FixContext) -> Any:
    import torch

    if finding.module:
        ctx.add(generalize(finding.module), torch.float32, "keep")
    return policy


RULE = AuditRule(META, scan=_scan, policy_fix=_policy_fix)
