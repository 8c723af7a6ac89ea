"""The measurement behind compare and tune: two recorded runs and one isolated run per call."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise.numerics._compare_iso import NO_ERR, Err, err, grad_err, isolated, sensitivity, unit_roundoff
from castwise.numerics._compare_run import (
    Call,
    Recording,
    loss_of,
    loss_scale,
    record,
    returns_loss,
    seed_all,
)
from castwise.numerics._compare_target import Target, prepared
from castwise.numerics._failed import raised_in
from castwise.run import Inputs

# what rounding explains: a module that rounds its inputs, weights and output to a format with
# unit roundoff u moves its output by about u (relative L2); ops that amplify rounding a little
# (softmax of large logits, GELU near its zero) stay inside 4 u on the models measured
# (benchmarks/bench_numerics_compare.py); planted sensitive modules sit orders of magnitude above
TOLERANCE_FACTOR = 4.0


@dataclass(frozen=True)
class ModuleNumerics:
    """One module's numbers: errors relative to the reference (relative L2 norms)."""

    module: str  # named_modules() name; "" is the model itself
    calls: int
    dtype: str  # the narrowest format it computed in under the policy
    out_err: float  # its output under the policy vs the reference
    added_err: float  # what it adds alone, on the reference's inputs (nan: it could not run alone)
    inherited_err: float  # the error already in its inputs
    grad_err: float | None  # d loss / d output under the policy vs the reference (train)
    param_grad_err: float | None  # its own parameters' gradients (train)
    tolerance: float  # what rounding to `dtype` explains
    sensitivity: float  # added error weighted by the reference's output gradient (AutoQuantize)
    order: int  # when its first call finished in the run (0 first)

    @property
    def past_tolerance(self) -> bool:
        return self.added_err > self.tolerance

    def to_dict(self) -> dict[str, Any]:
        def num(x: float | None) -> float | str | None:
            if x is None:
                return None
            return "inf" if math.isinf(x) else (None if math.isnan(x) else float(f"{x:.6g}"))

        return {
            "module": self.module,
            "calls": self.calls,
            "dtype": self.dtype,
            "out_err": num(self.out_err),
            "added_err": num(self.added_err),
            "inherited_err": num(self.inherited_err),
            "grad_err": num(self.grad_err),
            "param_grad_err": num(self.param_grad_err),
            "tolerance": num(self.tolerance),
            "past_tolerance": self.past_tolerance,
            "sensitivity": num(self.sensitivity),
        }


def loss_error(low: float, ref: float, scale: float) -> float:
    """|low - ref| relative to |ref|, or to the projection loss's typical size when larger."""
    if not math.isfinite(low):
        return math.inf
    return abs(low - ref) / max(abs(ref), scale, 1e-30)


@dataclass(frozen=True)
class Measurement:
    modules: tuple[ModuleNumerics, ...]  # ranked: largest added error first
    loss_ref: float
    loss_low: float
    output_err: float
    loss_scale: float = 0.0  # see loss_error
    has_loss: bool = True  # the model returned its own loss; else loss_* are of a random projection

    @property
    def metric(self) -> str:
        """What the model's result is measured by: its "loss", or its "output" when it returns none."""
        return "loss" if self.has_loss else "output"

    @property
    def loss_err(self) -> float:
        return loss_error(self.loss_low, self.loss_ref, self.loss_scale)

    def first_past_tolerance(self) -> ModuleNumerics | None:
        past = [m for m in self.modules if m.past_tolerance]
        return min(past, key=lambda m: m.order) if past else None


def reference_run(reference: Target) -> str:
    """How a reference run is named where it raised."""
    return f"the reference run ({reference})"


def _pair_calls(ref: Recording, low: Recording) -> list[tuple[Call, Call]]:
    """Calls of the two runs matched by (module name, occurrence)."""
    seen: dict[str, int] = defaultdict(int)
    by_key: dict[tuple[str, int], Call] = {}
    for call in low.calls:
        by_key[(call.name, seen[call.name])] = call
        seen[call.name] += 1
    seen.clear()
    pairs = []
    for call in ref.calls:
        other = by_key.get((call.name, seen[call.name]))
        seen[call.name] += 1
        if other is not None and other.out is not None and call.out is not None:
            pairs.append((other, call))
    return pairs


def _short(u: float) -> str:
    """The format name of a unit roundoff (each format's is distinct)."""
    from castwise._dtypes import short_of
    from castwise.numerics._compare_target import UNIT_ROUNDOFF

    return next((short_of(d) for d, v in UNIT_ROUNDOFF.items() if v == u), "f32")


def _param_grad_errs(model: nn.Module, ref: Recording, low: Recording) -> dict[str, Err]:
    out: dict[str, Err] = {}
    for name, _ in model.named_parameters():
        module = name.rsplit(".", 1)[0] if "." in name else ""
        if name in ref.param_grads and name in low.param_grads:
            out[module] = out.get(module, NO_ERR) + err(low.param_grads[name], ref.param_grads[name])
    return out


def _aggregate(
    pairs: list[tuple[Call, Call]], ref: Recording, low: Recording, low_model: nn.Module, mode: str
) -> list[ModuleNumerics]:
    children: dict[int, list[tuple[Call, Call]]] = defaultdict(list)
    for low_call, ref_call in pairs:
        if ref_call.parent is not None:
            children[ref_call.parent].append((low_call, ref_call))
    acc: dict[str, dict[str, Any]] = {}
    for low_call, ref_call in sorted(pairs, key=lambda p: p[1].index):
        callees = children.get(ref_call.index, [])
        try:
            iso, rounding = isolated(low_call, ref_call, callees)
        except Exception:  # a module that cannot run alone (state set by its caller)
            iso, rounding = None, NO_ERR
        a = acc.setdefault(
            low_call.name,
            {
                "calls": 0,
                "out": NO_ERR,
                "added": NO_ERR,
                "cast": NO_ERR,
                "inh": NO_ERR,
                "grad": NO_ERR,
                "sens": 0.0,
                "u": 0.0,
                "order": ref_call.done,
                "alone": True,
            },
        )
        a["calls"] += 1
        a["out"] += err(low_call.out, ref_call.out)
        if iso is None:
            a["alone"] = False
        else:
            a["added"] += err(iso, ref_call.out)
            a["cast"] += rounding
            a["sens"] += sensitivity(iso, ref_call)
        a["inh"] += err((low_call.args, low_call.kwargs), (ref_call.args, ref_call.kwargs))
        a["grad"] += grad_err(low_call.grads, ref_call.grads)
        a["u"] = max(a["u"], unit_roundoff(low_call, [c for c, _ in callees]))
    pgrads = _param_grad_errs(low_model, ref, low) if mode == "train" else {}
    rows = []
    for name, a in acc.items():
        train = mode == "train"
        rows.append(
            ModuleNumerics(
                name,
                a["calls"],
                _short(a["u"]),
                a["out"].value,
                _added(a["added"], a["cast"]) if a["alone"] else math.nan,
                a["inh"].value,
                a["grad"].value if train and a["grad"].den > 0 else None,
                pgrads[name].value if name in pgrads else None,
                TOLERANCE_FACTOR * a["u"],
                a["sens"],
                a["order"],
            )
        )
    return sorted(rows, key=lambda m: (-_finite_key(m.added_err), -_finite_key(m.sensitivity), m.order))


def _added(alone: Err, cast: Err) -> float:
    """What the module's own ops add: its error alone less the error of casting its inputs."""
    if alone.nonfinite:
        return math.inf
    return max(0.0, alone.value - cast.value)


def _finite_key(x: float) -> float:
    return 1e308 if math.isinf(x) else (-1.0 if math.isnan(x) else x)


def measure(
    model: nn.Module,
    inputs: Inputs,
    target: Target,
    reference: Target,
    mode: str,
    seed: int = 0,
    per_module: bool = True,
) -> Measurement:
    """Run the reference and the target on copies of ``model``; per module numbers if asked."""
    ref_model = prepared(model, reference, mode)
    low_model = prepared(model, target, mode)
    with raised_in(reference_run(reference), reference.full_policy):
        ref, dirs = record(ref_model, inputs, mode, None, seed)
    with raised_in(f"the policy's run ({target})", target.full_policy):
        low, _ = record(low_model, inputs, mode, dirs, seed)
    assert ref.loss is not None and low.loss is not None  # record always computes a loss
    rows: list[ModuleNumerics] = []
    if per_module:
        rows = _aggregate(_pair_calls(ref, low), ref, low, low_model, mode)
    output_err = err(low.output, ref.output).value
    return Measurement(
        tuple(rows), float(ref.loss), float(low.loss), output_err, loss_scale(ref.output), returns_loss(ref.output)
    )


def loss_only(
    model: nn.Module, inputs: Inputs, target: Target, mode: str, directions: list[torch.Tensor] | None, seed: int = 0
) -> tuple[float, Any]:
    """One plain run of ``target`` (no recording): the loss and the output."""
    from castwise.numerics._compare_run import call_model, projection

    twin = prepared(model, target, mode)
    seed_all(seed)
    with torch.no_grad(), raised_in(f"the policy's run ({target})", target.full_policy):
        out = call_model(twin, inputs)
        dirs = directions if directions is not None else projection(out)
        return float(loss_of(out, dirs)), out
