"""The fix that follows from a verdict: which module to keep wide, or which code to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

from castwise.rules.audit._text import where

if TYPE_CHECKING:
    from castwise.numerics.observe import Producer

# op -> what to change in the code (the op made NaN/Inf in float32 too)
_BUG_HINTS: dict[str, str] = {
    "aten.log": "log of zero or of a negative value: take `torch.log(x.clamp_min(eps))`, or `log_softmax` / "
    "`torch.special.xlogy` instead of log(softmax) or x*log(x)",
    "aten.log2": "log of zero: clamp the argument with `clamp_min(eps)`",
    "aten.log10": "log of zero: clamp the argument with `clamp_min(eps)`",
    "aten.div": "division by zero (0/0 is NaN): add an epsilon to the denominator or guard the rows whose "
    "count/norm is zero (`x / d.clamp_min(eps)`)",
    "aten.reciprocal": "reciprocal of zero: add an epsilon",
    "aten.rsqrt": "rsqrt of zero or of a negative value: add an epsilon inside (`rsqrt(var + eps)`)",
    "aten.sqrt": "sqrt of a negative value, or its gradient at zero (infinite): `sqrt(x + eps)` or "
    "`sqrt(x.clamp_min(eps))`",
    "aten.pow": "pow with a negative base and a fractional exponent, or its gradient at zero: clamp the base",
    "aten._softmax": "softmax over a row that is entirely -inf (every position masked) is 0/0: mask with "
    "`torch.finfo(dtype).min` instead of -inf, or zero the rows that are fully masked",
    "aten._log_softmax": "log_softmax over a row that is entirely -inf: keep at least one unmasked position "
    "per row, or mask with `torch.finfo(dtype).min`",
    "aten.sub": "inf - inf: an infinite mask value subtracted from itself (use `torch.finfo(dtype).min`)",
    "aten.add": "inf + (-inf): an infinite mask value meets its opposite (use `torch.finfo(dtype).min`)",
    "aten.mul": "0 * inf: an infinite mask value multiplied by zero (use `torch.finfo(dtype).min`)",
    "aten.exp": "exp of a large argument overflows in every dtype: subtract the maximum first "
    "(`torch.logsumexp`, `softmax`), or clamp the argument",
}


def precision_fix(p: Producer) -> str:
    if p.phase == "backward":
        return (
            f"Gradients in {where(p.module)} overflow the 16-bit dtype: use loss scaling "
            "(`torch.amp.GradScaler`, or the trainer's fp16 option, which skips such steps and lowers "
            "the scale), run in bfloat16 (float32's range), or keep the module in float32: "
            f"`keep[{p.module or '*'}]=f32` in the castwise policy."
        )
    return (
        f"Keep {where(p.module)} in float32 with a saturating cast back to the 16-bit dtype: add "
        f"`keep[{p.module or '*'}]=f32` to the castwise policy (castwise.apply), as transformers does for "
        "T5's `wo`; or run in bfloat16, whose range is float32's."
    )


def bug_fix(p: Producer) -> str:
    base = p.op.split(".")[0] + "." + p.op.split(".")[1] if p.op.count(".") >= 1 else p.op
    hint = _BUG_HINTS.get(base.rstrip("_"))
    if p.phase == "backward" and hint is None:
        hint = (
            f"the gradient formula of {p.node or p.op} is infinite at these inputs (e.g. sqrt, pow or "
            "norm at zero): add an epsilon in the forward code of this module"
        )
    if hint is None:
        hint = f"{p.op} makes NaN/Inf in float32 too: change the computation in the module's code"
    at = f" ({p.source})" if p.source else ""
    return f"Change the code of {where(p.module)}{at}: {hint}. A wider dtype does not help."
