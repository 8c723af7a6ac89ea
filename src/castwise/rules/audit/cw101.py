"""CW101 fp32-module-cast-to-low-precision: A module that computes in float32 has low-precision weights."""

from __future__ import annotations

from castwise._dtypes import is_low, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import keep_module_fix
from castwise.rules.audit._text import (
    generalize,
    true_preset,
    where,
)

META = Rule(
    code="CW101",
    name="fp32-module-cast-to-low-precision",
    category="KEEP_FP32_MODULE_DOWNCAST",
    severity="error",
    summary="A module that computes in float32 has low-precision weights.",
    detects=(
        "An op inside a module receives a float32 activation (the module casts its input up "
        "on purpose, like OpenCLIP's LayerNormFp32) together with bf16/fp16 parameters of "
        "that same module, and the real kernel refuses the mix."
    ),
    why=(
        "Some layers are written to run in float32 whatever the model's precision. A blanket "
        "`model.to(torch.bfloat16)` casts their weights too, so the float32 input they make "
        "meets low-precision weights: 'expected scalar type Float but found BFloat16'."
    ),
    example=(
        "model = open_clip.create_model('ViT-B-32', precision='bf16')\n"
        "model = model.to(torch.bfloat16)  # LayerNormFp32 weights become bf16\n"
        "model(image, text)  # visual.ln_pre: layer_norm(f32 input, bf16 weight) fails"
    ),
    fix=(
        "Keep the module's parameters in float32: `castwise.apply(model, "
        "Policy.parse('bf16-true'))` keeps norm layers as float32 islands, or avoid the "
        "blanket `.to(dtype)` and use the library's own precision option."
    ),
)


def _match(ctx: Ctx) -> Diag | None:
    # float32 made inside this module meets this module's own low-precision parameters
    module, provs = ctx.module, ctx.provs
    own_low = [
        p for p in provs if p is not None and p.kind in ("param", "buffer") and p.module == module and is_low(p.dtype)
    ]
    own_up = [
        p
        for i, p in enumerate(provs)
        if p is not None
        and short_of(ctx.dtypes[i]) == "f32"
        and p.kind in ("cast", "op", "created")
        and p.module == module
    ]
    if not (own_low and own_up):
        return None
    param = own_low[0]
    return ctx.diag(
        "CW101",
        f"{ctx.at} casts its input up to float32 ({own_up[0].op}) but its own {param.tensor} is "
        f"{short_of(param.dtype)}: the module computes in float32 and its weights were cast down "
        f"(a blanket `.to({short_of(param.dtype)})`?). Real error: {ctx.text}",
        f"Keep {where(module)}'s parameters in float32: policy `{true_preset(param.dtype)}` keeps norm "
        "layers as float32 islands"
        + (f" (or `keep[{generalize(module)}]=f32`)" if module else "")
        + "; avoid a blanket `.to(dtype)`.",
        param.origin(),
        (module,),
    )


RULE = AuditRule(META, checks=(Check("CW101", _match),), policy_fix=keep_module_fix)
