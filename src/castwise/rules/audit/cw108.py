"""CW108 attention-mask-dtype: An attention mask or bias is in a different floating dtype than the query."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import out_fix

META = Rule(
    code="CW108",
    name="attention-mask-dtype",
    category="MASK_DTYPE_MISMATCH",
    severity="error",
    summary="An attention mask or bias is in a different floating dtype than the query.",
    detects="scaled_dot_product_attention (or an attention kernel) gets a floating mask "
    "whose dtype differs from the query's.",
    why="Masks built with the default dtype stay float32 when the model runs in half.",
    example="mask = torch.zeros(t, t)  # f32\nF.scaled_dot_product_attention(q, k, v, mask)  # q bf16",
    fix="Build the mask with `dtype=q.dtype`, or use a boolean mask.",
)


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind != "mask":
        return None
    first = ctx.first
    return ctx.diag(
        "CW108",
        f"{ctx.at}: the attention mask ({first.describe() if first else ctx.got}) is "
        f"{ctx.got}, not the query's dtype. {ctx.text}",
        "Build the mask with `dtype=q.dtype`, or pass a boolean mask.",
    )


RULE = AuditRule(META, checks=(Check("CW108", _match),), policy_fix=out_fix)
