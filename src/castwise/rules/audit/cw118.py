"""CW118 built-after-conversion: A module made after the framework converted the model kept the dtype it was made in."""

from __future__ import annotations

from castwise._dtypes import short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._text import where

META = Rule(
    code="CW118",
    name="built-after-conversion",
    category="UNCONVERTED_TENSOR_OR_BUFFER",
    severity="error",
    summary="A module made after the framework converted the model kept the dtype it was made in.",
    detects=(
        "Under a framework that converts the model once at setup (Lightning's `*-true`: the precision "
        "plugin's convert_module, run by `fabric.setup` and the Trainer's strategy setup; castwise run "
        "audits it as `converted=on`), a module's own parameters are still in the dtype it was made in "
        "while the rest of the model is in the converted one, and the real kernel refuses the mix."
    ),
    why=(
        "The conversion is one `module.to(dtype)` over the modules that exist at that moment. A head made "
        "later (in `on_fit_start`, after `fabric.setup(model)`, or lazily in the first step) keeps float32 "
        "weights and meets bf16 activations: 'mat1 and mat2 must have the same dtype'. Nothing was cast by "
        "hand; the order of operations is the cause."
    ),
    example=(
        "def on_fit_start(self):  # runs after the Trainer's strategy converted the model to bf16\n"
        "    self.head = nn.Linear(8, 2)  # float32: the conversion never reached it"
    ),
    fix=(
        "Make the module before the conversion: in `__init__`, `configure_model()` or `setup()` (the "
        "Trainer converts after them), before `fabric.setup(model)`, or under `fabric.init_module()` / "
        "`trainer.init_module()`, which make it in the precision's dtype."
    ),
)


def _match(ctx: Ctx) -> Diag | None:
    if not ctx.converted or not ctx.stray or ctx.autocast is not None:
        return None
    own = [p for p in ctx.culprit_provs if p.kind in ("param", "buffer") and p.dtype != ctx.compute]
    if not own:
        return None
    first = min(own, key=lambda p: not (p.tensor or "").endswith(".weight"))  # the weight, where it is one
    dt, want = short_of(first.dtype), short_of(ctx.compute)
    return ctx.diag(
        "CW118",
        f"{ctx.at}: {where(first.module)}'s {first.tensor} is {dt} while the model around it is {want}: the framework "
        f"converted the model to {want} once, at setup (Lightning's precision plugin, convert_module), and "
        f"{where(first.module)} was made after that conversion, so it kept {dt}. Real error: {ctx.text}",
        f"Make {where(first.module)} before the conversion: in `__init__`, `configure_model()` or `setup()` (the "
        "Trainer converts after them), before `fabric.setup(model)`, or under `fabric.init_module()` / "
        "`trainer.init_module()`; no `.to()` by hand is needed.",
        first.origin(),
    )


RULE = AuditRule(META, checks=(Check("CW118", _match),), before="CW113")
