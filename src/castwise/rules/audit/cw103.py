"""CW103 fast-path-ignores-autocast: A fused fast path runs outside autocast and refuses the mixed dtypes."""

from __future__ import annotations

from typing import Any

from castwise.rules._rule import Rule
from castwise.rules.api import Ctx, Finding, FixContext
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._text import (
    others,
)

META = Rule(
    code="CW103",
    name="fast-path-ignores-autocast",
    category="FASTPATH_BYPASSES_AUTOCAST",
    severity="error",
    summary="A fused fast path runs outside autocast and refuses the mixed dtypes.",
    detects=(
        "TransformerEncoderLayer / MultiheadAttention take their fused C++ fast path "
        "(eval mode, no_grad) which does not apply autocast on CPU, so autocast's "
        "low-precision activations meet float32 weights."
    ),
    why=(
        "Training runs the Python path under autocast and works; the first validation step "
        "takes the fast path and crashes, after a whole epoch."
    ),
    example=(
        "layer = nn.TransformerEncoderLayer(32, 4, batch_first=True)\n"
        "model.eval()\n"
        "with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    model(x, src_key_padding_mask=mask)  # encoder.layers.0 fails"
    ),
    fix=(
        "Turn the fast path off while the model runs under autocast: a policy with "
        "`fastpath=off` (e.g. `bf16-mixed,fastpath=off`) does it inside `castwise.apply`; "
        "by hand, `torch.backends.mha.set_fastpath_enabled(False)`."
    ),
)


def _match(ctx: Ctx) -> Diag | None:
    if not ctx.is_fast:
        return None
    first = ctx.first
    src = first.describe() if first else "autocast"
    return ctx.diag(
        "CW103",
        f"{ctx.at} takes the fused fast path (eval mode, no_grad, which CPU autocast does not turn off) and "
        f"the fused kernel does no autocast: its {ctx.got} input ({src}) meets {others(ctx.dtypes, ctx.culprits)} "
        f"weights. Real error: {ctx.text}",
        "Turn the fast path off while autocast runs: add `fastpath=off` to the policy (castwise.apply "
        "does `torch.backends.mha.set_fastpath_enabled(False)` around the forward).",
    )


def _fix(policy: Any, finding: Finding, fx: FixContext) -> Any:
    return policy.replace(fastpath=False)


RULE = AuditRule(META, checks=(Check("CW103", _match),), policy_fix=_fix)
