"""CW114 autocast-disabled-region: a module's forward turns autocast off around layers fed by autocast."""

from __future__ import annotations

import inspect

from castwise._dtypes import is_low, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx, Origin
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._fixes import keep_culprits_fix
from castwise.rules.audit._text import generalize, where

META = Rule(
    code="CW114",
    name="autocast-disabled-region",
    category="UNCAST_CUSTOM_OP_OR_EXTENSION",
    severity="error",
    summary="A module turns autocast off in its forward, and autocast's low-precision activations reach it.",
    detects=(
        "Inside a model run under autocast, a module's forward runs part of its body under "
        "`torch.autocast(..., enabled=False)` (as custom ops and numerically sensitive blocks do) and "
        "an op there (a matmul, a conv) receives the bf16/f16 activations autocast made upstream "
        "together with float32 weights."
    ),
    why=(
        "Turning autocast off does not cast anything: activations made by autocast stay bf16/f16 and "
        "meet the module's float32 weights, and the kernel refuses the mix ('mat1 and mat2 must have "
        "the same dtype'). The error names the op; the cause is the region that turned autocast off."
    ),
    example=(
        "class Router(nn.Module):\n"
        "    def forward(self, x):\n"
        "        with torch.autocast('cpu', enabled=False):\n"
        "            return self.proj(x)  # x is bf16 from autocast upstream, proj.weight f32"
    ),
    fix=(
        "Cast the region's inputs to float32 where autocast is turned off (`x = x.float()`), or "
        "decorate the forward with `@torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32)`; "
        "as a policy, `keep[<module>]=f32` makes the module a float32 island (inputs cast in, output "
        "cast back)."
    ),
)


def _match(ctx: Ctx) -> Diag | None:
    region = ctx.disabled_by
    if region is None or ctx.phase != "forward":
        return None
    line = _region_line(ctx)
    origin = Origin(region or None, None, "autocast turned off in its forward")
    floats = sorted({d for d in ctx.dtypes if d.is_floating_point}, key=short_of)
    low = ", ".join(short_of(d) for d in floats if is_low(d)) or "low-precision"
    high = ", ".join(short_of(d) for d in floats if not is_low(d)) or "float32"
    return ctx.diag(
        "CW114",
        f"{ctx.at}: autocast is off here: {where(region)}'s forward runs this under "
        f"`torch.autocast(..., enabled=False)`, so {low} activations made by autocast upstream meet {high} "
        f"operands unconverted. Real error: {ctx.text}",
        f"Cast the inputs to float32 where {where(region)} turns autocast off (`x = x.float()`), or decorate its "
        "forward with `@torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32)`; as a policy, "
        f"`keep[{generalize(region)}]=f32` makes it a float32 island (inputs cast in, output cast back to "
        f"{ctx.comp}).",
        origin,
        (region,),
        source=line,
    )


def _region_line(ctx: Ctx) -> str | None:
    """file:line of the `enabled=False` in the region module's forward, when the source is readable."""
    module = ctx.region_module
    if module is None:
        return None
    from castwise._paths import short_path

    try:
        lines, start = inspect.getsourcelines(type(module).forward)
        path = inspect.getsourcefile(type(module).forward)
    except (OSError, TypeError):
        return None
    for i, text in enumerate(lines):
        if "enabled=False" in text.replace(" ", ""):
            return f"{short_path(path or '?')}:{start + i}"
    return f"{short_path(path or '?')}:{start}"


RULE = AuditRule(META, checks=(Check("CW114", _match),), policy_fix=keep_culprits_fix)
