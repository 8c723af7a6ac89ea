"""CW110 dtype-contract-violation: An op receives dtypes its real kernel refuses."""

from __future__ import annotations

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import out_fix

META = Rule(
    code="CW110",
    name="dtype-contract-violation",
    category="MODEL_INPUT_DTYPE_MISMATCH",
    severity="error",
    summary="An op receives dtypes its real kernel refuses.",
    detects="Any op whose inputs break the real kernel's dtype contract on the target "
    "device, when no more specific rule explains where the dtype came from.",
    why="Fake and meta kernels do not check dtypes as real kernels do; castwise checks "
    "every op against a table of what real kernels accept.",
    example="torch.mm(a_f32, b_bf16)",
    fix="Cast one side to the other's dtype where they first meet; the report's origin "
    "names where the odd dtype came from.",
)


def _embedding(ctx: Ctx) -> Diag | None:
    if ctx.op is None or "embedding" not in ctx.op or not any(d.is_floating_point for d in ctx.dtypes[1:2]):
        return None
    first = ctx.first
    src = f" (from {first.describe()})" if first else ""
    return ctx.diag(
        "CW110",
        f"{ctx.at} gets {short_of(ctx.dtypes[1])} indices{src}: embedding indices must be integers. {ctx.text}",
        "Pass the embedding int64 (or int32) indices: `ids.long()` where they are made; never cast "
        "token ids with the model's float dtype.",
    )


def _refused(ctx: Ctx) -> Diag | None:
    # the catch-all: the real kernel refuses, and no more specific rule says why
    first = ctx.first
    src = f" ({first.describe()})" if first else ""
    got = ctx.got or "mixed dtypes"
    return ctx.diag(
        "CW110",
        f"{ctx.at} receives {got}{src}, which its real kernel refuses: {ctx.text}",
        "Cast one side to the other's dtype where they first meet; the origin names where the odd dtype came from.",
    )


RULE = AuditRule(META, checks=(Check("CW110.embedding", _embedding), Check("CW110", _refused)), policy_fix=out_fix)
