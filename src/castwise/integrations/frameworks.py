"""The frameworks that run a model in a precision of their own (Lightning Fabric, Accelerate), as
`castwise run` meets them at a model's first call: the model to audit in place of the framework's
wrapper, the castwise policy that models the framework's precision, and what to tell the user.

A framework's precision lives in its wrapper (Fabric's ``_FabricModule.forward`` enters the
precision plugin's autocast; Accelerate's ``prepare_model`` replaces ``model.forward`` with an
autocast one), so the script is under no autocast at the call and the wrapper's own autocast is
on the device the script runs on. The audit therefore runs the user's module without the wrapper,
under the policy that says what the framework does (``lightning:<precision>``,
``accelerate:<mixed_precision>``): on the target device (``--device``), replaceable by
``--policy``, and named in the report. A Trainer has no wrapper to look through: Lightning's
calls training_step itself, transformers' runs Accelerate's autocast; the Trainer is read off the
call stack (``_running_trainer``) and names the precision. Neither framework is imported here: a
wrapper is only recognised when the script has imported its framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from castwise._compiled import compiled_parts
from castwise._dtypes import short_of
from castwise.errors import PolicyError
from castwise.policy import Policy
from castwise.policy import presets as _presets
from castwise.policy.grammar import clauses_against

__all__ = ["Framed", "framed", "framework_backward", "preset_note"]

_FABRIC_WRAPPERS = ("lightning.fabric.wrappers", "lightning_fabric.wrappers")
_LIGHTNING = ("lightning", "lightning_fabric", "pytorch_lightning")


@dataclass(frozen=True)
class Framed:
    """A model a framework runs: ``user`` is the user's module without the framework's wrapper,
    ``wrapper`` the module the script called; ``policy`` the castwise policy that does what
    ``setting`` does (None: not modelled, ``why_not`` says why)."""

    user: nn.Module
    wrapper: nn.Module
    framework: str  # "Lightning Fabric", "Accelerate"
    setting: str  # "precision='bf16-mixed'", "mixed_precision='bf16'"
    policy: str | None
    why_not: str = ""

    def audited(self, given: str | None) -> nn.Module:
        """What the audit copies and runs: the user's module under the policy (the framework's
        model of it, or ``--policy`` in its place); the wrapper as the script runs it where
        castwise does not model the framework's precision and no ``--policy`` replaces it."""
        return self.user if self.policy is not None or given is not None else self.wrapper

    @property
    def source(self) -> str:
        return f"{self.framework}'s {self.setting}"

    def describe(self, given: str | None) -> str:
        """What the report's title adds after the policy it names: where that policy comes from."""
        if self.policy is None:
            return f"{'' if given is not None else ', as the script runs it'}: {self.source} {self.why_not}"
        if given is None:
            return f" = {self.source}"
        mine, theirs = Policy.parse(given), Policy.parse(self.policy)
        note = ""
        if mine.is_mixed and not theirs.is_mixed and theirs.param_dtype != mine.param_dtype:
            # a mixed policy casts no weight: what the framework converted at setup stays converted
            note = f"; the weights stay as {self.framework} converted them at setup"
        return f" given in place of {self.source}{note}"

    def to_dict(self, given: str | None) -> dict[str, Any]:
        return {
            "name": self.framework,
            "setting": self.setting,
            "policy": self.policy,
            "replaced_by": given,
            **({"why_not": self.why_not} if self.policy is None else {}),
        }


def framed(module: nn.Module) -> Framed | None:
    """The framework ``module`` is the wrapper of, or whose Trainer is calling it; None: a plain
    module run by the script itself."""
    found = _fabric(module) or _accelerate(module)
    trainer = _running_trainer()
    if trainer is None:
        return found
    kind, owner = trainer
    if kind == "Lightning Trainer":
        # the Trainer calls training_step itself (strategy.training_step, inside the precision
        # plugin's train_step_context): the model is the user's, no wrapper to look through
        setting = str(owner.precision)
        policy, why = _modelled(f"lightning:{setting}")
        return Framed(module, module, kind, f"precision={setting!r}", policy, why)
    # transformers' Trainer runs its precision through Accelerate (Trainer.create_accelerator_and_postprocess
    # passes TrainingArguments' bf16/fp16 as mixed_precision): the policy is Accelerate's, named as the user set it
    args = owner.args
    flags = [f"{name}=True" for name in ("bf16", "fp16") if getattr(args, name, False)]
    setting = f"TrainingArguments({', '.join(flags) or 'bf16=False, fp16=False'})"
    if found is None:
        return None  # no precision of the Trainer's: the model runs as it is
    through = f" through Accelerate's {found.setting}"
    return dataclasses.replace(found, framework=kind, setting=setting + through)


def _running_trainer() -> tuple[str, Any] | None:
    """The Trainer whose step is calling the model, read off the call stack: a frame whose ``self``
    is a transformers ``Trainer``, or a LightningModule attached to a Lightning ``Trainer``. Neither
    library is imported here: only one the script imported is looked for."""
    hf = sys.modules.get("transformers.trainer")
    lightning = [m for m in (sys.modules.get(n) for n in ("lightning.pytorch", "pytorch_lightning")) if m is not None]
    if hf is None and not lightning:
        return None
    modules = tuple(m.LightningModule for m in lightning)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if hf is not None and isinstance(owner, hf.Trainer):
            return "transformers Trainer", owner
        if modules and isinstance(owner, modules) and getattr(owner, "_trainer", None) is not None:
            return "Lightning Trainer", owner._trainer
        frame = frame.f_back
    return None


def _modelled(text: str) -> tuple[str | None, str]:
    try:
        parsed = Policy.parse(text)
    except PolicyError as exc:
        return None, f"is not modelled ({exc})"
    if parsed.float8 is not None and text.startswith("lightning:"):
        # as CastwiseCallback: Lightning's float8 is TransformerEngine's, apply converts torchao's recipes
        return (
            None,
            f"is not modelled (TransformerEngine's float8, {parsed.float8} scaling, is not one castwise converts)",
        )
    if text.startswith("lightning:") and not parsed.is_mixed and parsed != Policy.parse("32-true"):
        # Lightning converted the module once, at setup (the plugin's convert_module), before any step:
        # the audit runs the tensors as it left them, so a module made after that keeps its dtype (CW118)
        return f"{text},converted=on", ""
    return text, ""


def _fabric(module: nn.Module) -> Framed | None:
    classes = tuple(getattr(sys.modules[n], "_FabricModule") for n in _FABRIC_WRAPPERS if n in sys.modules)  # noqa: B009
    if not classes or not isinstance(module, classes):
        return None
    plugin = module._strategy.precision
    # every Fabric precision plugin names its precision string (plugins/precision/precision.py:
    # Precision.precision, "32-true" for the base class)
    setting = str(getattr(plugin, "precision", "32-true"))
    policy, why = _modelled(f"lightning:{setting}")
    wanted = getattr(plugin, "_desired_input_dtype", None)
    if policy is not None and wanted is not None and Policy.parse(policy).is_mixed:
        # MixedPrecision.convert_input (plugins/precision/amp.py) casts the floating inputs to the
        # autocast dtype before the forward; castwise's mixed presets leave inputs as they are
        policy += f",inputs={short_of(wanted)}"
    # _FabricModule.module is the user's module (wrappers.py: original_module, else forward_module);
    # the wrapper's forward is convert_input, the plugin's forward_context and convert_output,
    # which the policy models, plus a backward hook that only guards fabric.backward (below)
    user = module.module
    forward = module._forward_module
    parts = compiled_parts(forward)
    if parts is not None and parts[0] is user:
        # setup took the user's torch.compile off, converted the module and compiled it again
        # (fabric.py: _unwrap_compiled, _to_compiled): the compiled module is what the script runs
        user = forward
    return Framed(user, module, "Lightning Fabric", f"precision={setting!r}", policy, why)


def _accelerate(module: nn.Module) -> Framed | None:
    original = module.__dict__.get("_original_forward")
    state = sys.modules.get("accelerate.state")
    if state is None or not module.__dict__.get("_is_accelerate_prepared"):
        return None
    setting = str(state.AcceleratorState._shared_state.get("_mixed_precision", "no"))
    if original is None or "forward" not in module.__dict__:
        if setting != "fp16":
            return None  # no autocast of Accelerate's: the model runs as it is
        # Accelerator.__init__ (accelerator.py) turns native AMP on for fp16 only off the CPU: here
        # the model runs in its own dtypes, on a GPU under f16 autocast with a GradScaler
        why = (
            "has no autocast on cpu (its native AMP is off for fp16 there); "
            "--policy accelerate:fp16 audits it as on a GPU"
        )
        return Framed(module, module, "Accelerate", f"mixed_precision={setting!r}", None, why)
    # Accelerator.prepare_model (accelerator.py) keeps the forward it replaced as _original_forward
    # when native AMP is on, and wraps forward in get_mixed_precision_context_manager's autocast
    # (utils/modeling.py) and convert_outputs_to_fp32: what accelerate:<mixed_precision> models
    policy, why = _modelled(f"accelerate:{setting}")
    return Framed(_forward_view(module, original), module, "Accelerate", f"mixed_precision={setting!r}", policy, why)


def _forward_view(module: nn.Module, forward: Any) -> nn.Module:
    """``module`` with ``forward`` in place of the framework's: the same state (shared: the audit
    copies it), the user's object untouched. A method bound to ``module`` is bound to the view, so
    that the audit's copy runs its own (bound to the module, the copy would run the user's)."""
    view: nn.Module = object.__new__(type(module))
    state = dict(module.__dict__)
    state.pop("forward")
    for name, value in state.items():
        if isinstance(value, types.MethodType) and value.__self__ is module:
            state[name] = types.MethodType(value.__func__, view)
    own = isinstance(forward, types.MethodType) and forward.__self__ is module
    if not (own and forward.__func__ is type(module).forward):  # the class's forward: no instance one
        state["forward"] = types.MethodType(forward.__func__, view) if own else forward
    view.__dict__.update(state)
    return view


@contextlib.contextmanager
def framework_backward(framework: Framed | None) -> Iterator[None]:
    """The audit's ``loss.backward()`` as the framework's backward runs it. Fabric's wrapper hooks
    its outputs with a guard that refuses a backward outside ``fabric.backward`` (wrappers.py:
    _backward_hook, raised unless _in_fabric_backward); ``Fabric.backward`` (fabric.py) sets that
    flag around the strategy's backward, whose precision part (a GradScaler's scale) the policy's
    loss scaling models. Auditing the wrapper itself (a precision castwise does not model), the flag
    is set as there; Accelerate's ``backward`` has no guard (scale, then ``loss.backward()``)."""
    names = [n for n in _FABRIC_WRAPPERS if n in sys.modules] if framework is not None else []
    saved = [getattr(sys.modules[n], "_in_fabric_backward", False) for n in names]
    for n in names:
        setattr(sys.modules[n], "_in_fabric_backward", True)  # noqa: B010
    try:
        yield
    finally:
        for n, value in zip(names, saved, strict=True):
            setattr(sys.modules[n], "_in_fabric_backward", value)  # noqa: B010


def preset_note(policy: str) -> str | None:
    """Where ``policy``'s bare preset (``bf16-true``) is castwise's own and Lightning's string of
    the same name means something else, when the script runs Lightning: what differs, and the
    string that means Lightning's. None: not a script of Lightning's, or no difference."""
    if not any(name in sys.modules for name in _LIGHTNING):
        return None
    head = policy.split(",", 1)[0].strip()
    key = _presets.LIGHTNING_ALIASES.get(head.lower(), head.lower())
    if ":" in head or key not in _presets.LIGHTNING:
        return None
    ours, theirs = Policy.parse(head), Policy.parse(f"lightning:{head}")
    if ours == theirs:
        return None
    differs = clauses_against(_values(theirs), _values(ours)) if ours.param_dtype == theirs.param_dtype else None
    what = f"Lightning's is {head} with {', '.join(differs)}" if differs else f"Lightning's is {theirs}"
    return (
        f"--policy {head} is castwise's {head}, not Lightning's: {what} (its precision plugin converts the "
        f"whole module and sets torch's default dtype while a step runs); --policy lightning:{head} audits "
        "what Lightning runs"
    )


def _values(policy: Policy) -> dict[str, Any]:
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
