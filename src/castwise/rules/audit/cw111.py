"""CW111 dtype-unsupported-on-device: The target device has no kernel for this op in this dtype."""

from __future__ import annotations

from castwise._dtypes import name_of, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import keep_module_fix
from castwise.rules.audit._text import (
    keep_fix,
    where,
)

META = Rule(
    code="CW111",
    name="dtype-unsupported-on-device",
    category="DTYPE_UNSUPPORTED_ON_DEVICE",
    severity="error",
    summary="The target device has no kernel for this op in this dtype.",
    detects="An op is called in a dtype the target device's kernel does not implement.",
    why="A dtype that works on one device may have no kernel on another.",
    example="torch.view_as_complex(x.bfloat16())",
    fix="Run that op in a supported dtype (an fp32 island around it).",
)


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind != "unsupported":
        return None
    # one dtype has no kernel: nothing to cast "to the other side", run the op in float32
    dtypes, first = ctx.dtypes, ctx.first
    bad = (
        ctx.unsupported
        or next((dtypes[i] for i in ctx.culprits if i < len(dtypes)), None)
        or next((d for d in dtypes if d.is_floating_point), None)
    )
    name = short_of(bad) if bad is not None else ctx.got or "this dtype"
    src = f" (its {name} operand: {first.describe()})" if first is not None else ""
    message = (
        f"{ctx.at} has no {ctx.device.label} kernel for {name}"
        f"{' in backward' if ctx.phase == 'backward' else ''}{src}: {ctx.text}"
    )
    if bad is not None and not bad.is_floating_point:
        return ctx.diag(
            "CW111",
            message,
            f"Cast the {name} tensor to a floating dtype before {where(ctx.module)} "
            f"(`x.to(torch.{name_of(ctx.compute)})`).",
        )
    back = (
        f"; its input is cast up to float32 and its output back to {ctx.comp}"
        if ctx.comp != "f32" and ctx.module
        else ""
    )
    return ctx.diag("CW111", message, keep_fix(ctx.module) + back + ".")


RULE = AuditRule(META, checks=(Check("CW111", _match),), policy_fix=keep_module_fix)
