"""CW115 hook-changes-dtype: a user hook returns a tensor in another dtype than it was given."""

from __future__ import annotations

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx, HookChange, Origin
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._text import where

META = Rule(
    code="CW115",
    name="hook-changes-dtype",
    category="OPTIMIZER_OR_GRAD_DTYPE",
    severity="error",
    summary="A gradient or forward hook returns a tensor in another dtype than it was given.",
    detects=(
        "A hook registered with `param.register_hook` returns the gradient in another dtype (backward "
        'raises "hook ... has changed the type of value"), or a module\'s forward hook returns its '
        "output in another dtype, which the next layer refuses."
    ),
    why=(
        "Autograd requires a gradient in its tensor's dtype, and layers require activations in their "
        "weights' dtype; a hook sits outside both, so the error shows in the engine or in the next "
        "layer, never at the hook. Gradient-clipping, logging and noise hooks are the usual source."
    ),
    example=(
        "model.lm_head.weight.register_hook(lambda g: g.float())  # bf16 weight, f32 gradient\n"
        "loss.backward()  # RuntimeError: hook '<lambda>' has changed the type of value"
    ),
    fix=(
        "Return the hook's result in the dtype it was given: `return new.to(grad.dtype)` in a gradient "
        "hook, `return out.to(output.dtype)` in a forward hook (compute in float32 inside it if needed)."
    ),
)


def _forward_hook(ctx: Ctx) -> Diag | None:
    first = ctx.first
    if first is None or first.op is None or "in forward hook" not in first.op:
        return None
    hook = first.op.split("in forward hook", 1)[1].strip()
    return ctx.diag(
        "CW115",
        f"{ctx.at} gets {short_of(first.dtype)} from the forward hook {hook} on {where(first.module)}, which "
        f"returns that module's output in another dtype. Real error: {ctx.text}",
        f"Return the hook's result in the dtype it was given (`return out.to(output.dtype)` in {hook}).",
        modules=(first.module,),
    )


def grad_hook_diag(change: HookChange, text: str, origin: Origin) -> Diag:
    """Backward raised because a gradient hook changed the gradient's dtype (``origin``: the
    hooked parameter)."""
    return Diag(
        "CW115",
        change.module,
        None,
        origin,
        f"The gradient hook {change.hook} on {change.tensor} (in {where(change.module)}) returns "
        f"{short_of(change.after)} for a {short_of(change.before)} gradient; autograd refuses it. Real error: "
        f"{text}",
        f"Return the gradient in its own dtype: `return new_grad.to(grad.dtype)` in {change.hook}"
        + (f" ({change.source})" if change.source else "")
        + ".",
        (change.module,) if change.module else (),
        None,
        change.source,
        change.code_fix,
        (("hook", change.hook), ("hook_kind", change.kind)),
    )


RULE = AuditRule(META, checks=(Check("CW115", _forward_hook),))
