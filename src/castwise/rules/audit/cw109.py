"""CW109 norm-dtype-mismatch: A norm layer's weights or running statistics differ from its input's dtype."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import keep_module_fix

META = Rule(
    code="CW109",
    name="norm-dtype-mismatch",
    category="NORM_PARAM_OR_STATS_DTYPE",
    severity="error",
    summary="A norm layer's weights or running statistics differ from its input's dtype.",
    detects="batch_norm / group_norm / layer_norm receive an input in one dtype and "
    "weights or running statistics in another that the kernel refuses.",
    why="Half converters often keep norm layers in float32, which some kernels refuse.",
    example="bn = nn.BatchNorm2d(8)  # f32\nbn(x.half())  # eval mode, CPU",
    fix="Make the norm an fp32 island (input cast up, output cast back): the `*-true` "
    "presets keep norms in float32 with casts at their boundaries.",
)


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind != "norm":
        return None
    return ctx.diag(
        "CW109",
        f"{ctx.at}: norm input and weights/statistics differ ({ctx.got}). {ctx.text}",
        "Make the norm a float32 island (input cast up, output cast back): the `*-true` presets "
        "keep norms in float32 with casts at their boundaries.",
    )


RULE = AuditRule(META, checks=(Check("CW109", _match),), policy_fix=keep_module_fix)
