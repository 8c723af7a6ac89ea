"""CW113 module-weights-cast-by-hand: One module's weights were cast to another dtype than the rest of the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from castwise._dtypes import name_of, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx, ProvLike
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._text import (
    module_expr,
    where,
)

if TYPE_CHECKING:
    import torch


META = Rule(
    code="CW113",
    name="module-weights-cast-by-hand",
    category="MODEL_INPUT_DTYPE_MISMATCH",
    severity="error",
    summary="One module's weights were cast to another dtype than the rest of the model.",
    detects=(
        "Outside autocast, an op of a module meets that module's own parameters in one dtype "
        "and activations in the model's dominant dtype (the dtype of most of its parameters), "
        "and the real kernel refuses the mix."
    ),
    why=(
        "A single `.to(torch.bfloat16)` / `.half()` on one submodule leaves it out of step "
        "with the float32 model around it: 'mat1 and mat2 must have the same dtype'. The "
        "module upstream did nothing wrong."
    ),
    example=(
        "self.a = nn.Linear(4, 4)\n"
        "self.b = nn.Linear(4, 4).to(torch.bfloat16)  # cast by hand\n"
        "self.b(self.a(x))  # b's bf16 weights meet a's f32 output"
    ),
    fix=(
        "Cast that module back with the rest of the model (`model.b.float()`; the `32-true` "
        "policy casts every module), or cast its input to its dtype if it is meant to run "
        "in low precision."
    ),
)


def _hand_cast(ctx: Ctx) -> tuple[ProvLike, torch.dtype] | None:
    """(the module's odd parameter, the activations' dtype) when this module's own weights are off
    the model's dominant dtype while everything else reaching it is in it: weights cast by hand."""
    module, dtypes, provs, dominant = ctx.module, ctx.dtypes, ctx.provs, ctx.dominant
    if ctx.autocast is not None or dominant is None or not module:
        return None
    own_odd = [
        p
        for p in provs
        if p is not None
        and p.kind in ("param", "buffer")
        and p.module == module
        and p.dtype.is_floating_point
        and p.dtype != dominant
    ]

    def own(i: int) -> bool:
        p = provs[i]
        return p is not None and p.kind in ("param", "buffer") and p.module == module

    rest = [d for i, d in enumerate(dtypes) if d.is_floating_point and i < len(provs) and not own(i)]
    if own_odd and rest and all(d == dominant for d in rest):
        # name the weight when it is among them (the bias comes first in addmm's operands)
        own_odd.sort(key=lambda p: not (p.tensor or "").endswith(".weight"))
        return own_odd[0], dominant
    return None


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind == "mask":
        return None
    found = _hand_cast(ctx)
    if found is None:
        return None
    param, act = found
    return ctx.diag(
        "CW113",
        f"{ctx.at}: {where(param.module)}'s own {param.tensor} is {short_of(param.dtype)} while the rest of the "
        f"model and the activations reaching it are {short_of(act)}: that module's weights were cast by hand "
        f"(`.to({short_of(param.dtype)})` on one module?). Real error: {ctx.text}",
        f"Cast {where(param.module)} back to {short_of(act)} with the rest of the model "
        f"(`{module_expr(param.module)}.to(torch.{name_of(act)})`), or, if it is meant to run in "
        f"{short_of(param.dtype)}, cast its input: `x.to(torch.{name_of(param.dtype)})` before it.",
        param.origin(),
        (param.module,),
    )


RULE = AuditRule(META, checks=(Check("CW113", _match),))
