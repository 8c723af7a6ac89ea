"""CW105 input-dtype-mismatch: Model inputs and weights are in different dtypes, with no autocast."""

from __future__ import annotations

from typing import Any

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx, Finding, FixContext
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._text import (
    others,
)

META = Rule(
    code="CW105",
    name="input-dtype-mismatch",
    category="MODEL_INPUT_DTYPE_MISMATCH",
    severity="error",
    summary="Model inputs and weights are in different dtypes, with no autocast.",
    detects=(
        "An op receives a model input (or a tensor derived from it) in one floating dtype "
        "and parameters in another, outside autocast."
    ),
    why=(
        "Casting a model with .half()/.bfloat16() does not cast its inputs: 'Input type "
        "(float) and bias type (c10::BFloat16) should be the same'."
    ),
    example="model = model.bfloat16()\nmodel(torch.randn(2, 8))  # float32 input",
    fix=(
        "Cast the inputs with the model: a policy with `inputs=bf16` (the `*-true` presets "
        "do it), or run a float32 model under autocast (`bf16-mixed`)."
    ),
)


def _match(ctx: Ctx) -> Diag | None:
    first = ctx.first
    if first is None or first.kind != "input":
        return None
    rest = others(ctx.dtypes, ctx.culprits)
    meets = f"{rest} weights" if rest else f"weights in another dtype (the model computes in {ctx.comp})"
    return ctx.diag(
        "CW105",
        f"{ctx.at}: {first.tensor} is {short_of(first.dtype)} but meets {meets}, with no autocast. "
        f"Real error: {ctx.text}",
        f"Cast the inputs with the model: policy clause `inputs={rest or ctx.comp}`.",
    )


def _fix(policy: Any, finding: Finding, fx: FixContext) -> Any:
    return policy if policy.is_mixed else policy.replace(input_dtype=policy.param_dtype)


RULE = AuditRule(META, checks=(Check("CW105", _match),), policy_fix=_fix)
