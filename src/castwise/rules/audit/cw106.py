"""CW106 unconverted-tensor: A tensor made in forward (or kept outside the module tree) has the wrong dtype."""

from __future__ import annotations

from castwise._dtypes import name_of, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import out_fix
from castwise.rules.audit._text import (
    dtype_code_fix,
    others,
)

META = Rule(
    code="CW106",
    name="unconverted-tensor",
    category="UNCONVERTED_TENSOR_OR_BUFFER",
    severity="error",
    summary="A tensor made in forward (or kept outside the module tree) has the wrong dtype.",
    detects=(
        "An op receives a tensor created inside forward with the default dtype (arange, "
        "zeros, a timestep table) or a plain tensor attribute, in a different dtype than "
        "the activations it meets."
    ),
    why="Module.to(dtype) only reaches parameters and registered buffers.",
    example=(
        "freqs = torch.arange(half) / half  # float32, made in forward\n"
        "self.linear(x * freqs)  # x and weights are bf16"
    ),
    fix="Create the tensor with `dtype=x.dtype`, or register it as a buffer.",
)


def _match(ctx: Ctx) -> Diag | None:
    first = ctx.first
    if first is None or first.kind not in ("created", "attribute"):
        return None
    rest = others(ctx.dtypes, ctx.culprits)
    # the dtype the tensor should have: that of the operands it meets (one of them, if several)
    want = next((d for i, d in enumerate(ctx.dtypes) if i not in ctx.culprits and d.is_floating_point), None)
    code_fix = dtype_code_fix(first.source, f"torch.{name_of(want)}") if first.kind == "created" and want else None
    where_made = f" at {first.source}" if first.source else ""
    return ctx.diag(
        "CW106",
        f"{ctx.at}: {first.describe()}{where_made} is {short_of(first.dtype)} (made with the default dtype, or "
        f"a tensor attribute .to() does not convert) and meets {rest}. Real error: {ctx.text}",
        "Create the tensor with `dtype=x.dtype` (or register it as a buffer so the model's casts reach it)"
        + (f": {code_fix[0]}:{code_fix[1]} becomes `{code_fix[2].strip()}`." if code_fix else "."),
        code_fix=code_fix,
    )


RULE = AuditRule(META, checks=(Check("CW106", _match),), policy_fix=out_fix)
