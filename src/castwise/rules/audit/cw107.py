"""CW107 strict-same-dtype-op: An op that needs identical dtypes (index_put, scatter, masked_scatter...) got two."""

from __future__ import annotations

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import out_fix

META = Rule(
    code="CW107",
    name="strict-same-dtype-op",
    category="STRICT_SAME_DTYPE_OP",
    severity="error",
    summary="An op that needs identical dtypes (index_put, scatter, masked_scatter...) got two.",
    detects=(
        "index_put / advanced-index assignment, masked_scatter, scatter, in-place updates "
        "and similar ops that autocast does not promote receive different floating dtypes."
    ),
    why=(
        "These ops are outside autocast's lists; mixing encoder features into float32 "
        "embeddings or writing into a preallocated buffer fails: 'Index put requires the "
        "source and destination dtypes match'."
    ),
    example="embeds[mask] = image_features  # f32 embeds, bf16 features",
    fix="Cast the source to the destination's dtype at the write: `src.to(dst.dtype)`.",
)


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind not in ("strict", "index"):
        return None
    first = ctx.first
    mixed = ", ".join(short_of(d) for d in ctx.dtypes if d.is_floating_point)
    return ctx.diag(
        "CW107",
        f"{ctx.at} needs identical dtypes and got {mixed}"
        f" ({first.describe() if first else 'unknown origin'}). {ctx.text}",
        "Cast the source to the destination's dtype at the write: `src.to(dst.dtype)`.",
    )


RULE = AuditRule(META, checks=(Check("CW107", _match),), policy_fix=out_fix)
