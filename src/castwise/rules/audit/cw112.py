"""CW112 gradient-dtype-mismatch: In backward, a gradient's dtype differs from what its tensor needs."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag

META = Rule(
    code="CW112",
    name="gradient-dtype-mismatch",
    category="OPTIMIZER_OR_GRAD_DTYPE",
    severity="error",
    summary="In backward, a gradient's dtype differs from what its tensor needs.",
    detects="A backward op receives a gradient in a different dtype from its forward "
    "tensor, or a gradient hook changes the dtype.",
    why="Backward fails after forward succeeded, often only at the first training step.",
    example="x.register_hook(lambda g: g.float())  # on a bf16 tensor",
    fix="Keep gradients in their tensor's dtype; cast the loss, not the gradients.",
)


def _match(ctx: Ctx) -> Diag | None:
    if ctx.phase != "backward":
        return None
    return ctx.diag(
        "CW112",
        f"In backward, {ctx.at} refuses its gradients' dtypes ({ctx.text}).",
        "Keep gradients in their tensor's dtype: cast the loss, not the gradients (no dtype-changing gradient hooks).",
    )


RULE = AuditRule(META, checks=(Check("CW112", _match),))
