"""CW102 fp32-leak-into-strict-op: float32 from a module kept in float32 reaches an op that refuses it."""

from __future__ import annotations

from castwise._dtypes import is_low, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import keep_culprits_fix
from castwise.rules.audit._text import (
    generalize,
    is_ancestor,
    true_preset,
    where,
)

META = Rule(
    code="CW102",
    name="fp32-leak-into-strict-op",
    category="KEEP_FP32_MODULE_LEAK",
    severity="error",
    summary="float32 from a module kept in float32 reaches an op that refuses it.",
    detects=(
        "A low-precision op receives a float32 tensor whose float32 dtype comes from a "
        "module kept in float32 (transformers' _keep_in_fp32_modules, a user's fp32 layer), "
        "possibly several layers earlier through the residual stream."
    ),
    why=(
        "Modules kept in float32 to avoid overflow return float32. Added to a half-precision "
        "residual stream the whole stream becomes float32, and the first strict consumer "
        "(a fused norm, a Linear outside autocast) fails far from the cause."
    ),
    example=(
        "model = T5EncoderModel.from_pretrained(path, dtype=torch.float16)  # wo kept fp32\n"
        "# encoder.block.0...wo returns f32; encoder.block.1's fused norm refuses it"
    ),
    fix=(
        "Cast the kept-float32 module's output back to the compute dtype (saturating to "
        "float16's range): `castwise.apply(model, Policy.parse('16-true'))` does this for "
        "_keep_in_fp32_modules; or run in bfloat16, which needs no fp32 islands."
    ),
)


def _match(ctx: Ctx) -> Diag | None:
    first, comp = ctx.first, ctx.comp
    if first is None or first.kind not in ("param", "buffer") or short_of(first.dtype) != "f32":
        return None
    if is_ancestor(first.module, ctx.module) or not is_low(ctx.compute):
        return None
    fix = (
        f"Cast {where(first.module)}'s output back to {comp} (saturating for f16): "
        f"`keep[{generalize(first.module)}]=f32` islands cast back; `{true_preset(ctx.compute)}` does "
        "it for _keep_in_fp32_modules."
        if first.module
        else f"Cast the float32 back to {comp} where it is made (the model's top level)."
    )
    return ctx.diag(
        "CW102",
        f"{ctx.at} gets float32 from {where(first.module)} ({first.tensor}), a module kept in float32 "
        f"whose output is not cast back, in a model computing in {comp}. Real error: {ctx.text}",
        fix,
    )


RULE = AuditRule(META, checks=(Check("CW102", _match),), policy_fix=keep_culprits_fix)
