"""CW104 fp32-into-low-precision-kernel: An op that only takes fp16/bf16 (or equal q/k/v dtypes) gets float32."""

from __future__ import annotations

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import out_fix
from castwise.rules.audit._text import (
    generalize,
)

META = Rule(
    code="CW104",
    name="fp32-into-low-precision-kernel",
    category="AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL",
    severity="error",
    summary="An op that only takes fp16/bf16 (or equal q/k/v dtypes) gets float32.",
    detects=(
        "A kernel that is not autocast-aware (fused attention, flash/xFormers kernels, "
        "custom ops) receives float32 made by autocast (layer_norm, softmax run in float32 "
        "on CUDA) or by fp32 parameters, next to low-precision tensors."
    ),
    why=(
        "Autocast's float32 ops return float32. On CUDA, layer_norm of q and k returns "
        "float32 while v stays bf16; the kernel refuses. CPU autocast keeps layer_norm in "
        "bf16, so the bug is invisible on a laptop."
    ),
    example=(
        "q, k = self.q_norm(q), self.k_norm(k)  # float32 under CUDA autocast\n"
        "memory_efficient_attention(q, k, v)   # v is bf16: refused"
    ),
    fix=(
        "Cast the float32 tensors to the kernel's dtype right before it: a policy rule "
        "`out[*.q_norm]=bf16` casts a module's output, or `q = q.to(v.dtype)` in code."
    ),
)


def _match(ctx: Ctx) -> Diag | None:
    first = ctx.first
    if first is None or first.kind != "autocast" or short_of(first.dtype) != "f32":
        return None
    comp = ctx.comp
    rules = ", ".join(f"`out[{generalize(m)}]={comp}`" for m in (ctx.modules or (first.module,)) if m)
    return ctx.diag(
        "CW104",
        f"{ctx.at} takes only float16/bfloat16 operands of one dtype, but gets float32 {first.describe()} "
        f"(autocast runs that op in float32 on this device). Real error: {ctx.text}",
        f"Cast the float32 tensors to {comp} right before the kernel: policy rule "
        + (rules or "(the float32 is made at the model's top level: no module rule reaches it)")
        + f", or `x.to({comp})` in code.",
    )


RULE = AuditRule(META, checks=(Check("CW104", _match),), policy_fix=out_fix)
