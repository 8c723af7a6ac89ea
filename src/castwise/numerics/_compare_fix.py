"""The one fix for compare's findings: a float32 island, verified by re-running the policy with it.

Modules past tolerance often share one cause (five norms of one class, each adding error on the
same kind of input), and an island on each alone leaves the error where it was. The candidates,
cheapest first: the first module past tolerance in the run (what the others may inherit from),
one clause over the class they share, their innermost common parent, then the others alone. The
first whose run alone lowers the error ``VERIFIED_FACTOR`` times is the fix for every finding it
covers; none verified: the best is named, said to be unverified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise.numerics._compare_core import Measurement, ModuleNumerics, loss_error, loss_only, reference_run
from castwise.numerics._compare_iso import err
from castwise.numerics._compare_target import Target, _literal, prepared
from castwise.numerics._failed import RunRaised, raised_in
from castwise.policy import ModuleRule
from castwise.run import Inputs

VERIFIED_FACTOR = 4.0  # the error reduction that makes an island the fix
MAX_RUNS = 6  # re-runs of the policy spent looking for it


class ErrorOf:
    """The model's error under ``target`` plus islands, one plain run each (tune and compare)."""

    def __init__(self, model: nn.Module, inputs: Inputs, target: Target, mode: str, metric: str, m: Measurement | None):
        self.model, self.inputs, self.target, self.mode, self.metric = model, inputs, target, mode, metric
        # the loss metric's reference (none needed to compare outputs)
        self.ref_loss, self.scale = (m.loss_ref, m.loss_scale) if m is not None else (math.nan, 0.0)
        self.ref_out: Any = None
        self.dirs: list[torch.Tensor] | None = None
        self.runs = 0

    def reference(self, ref_out: Any, dirs: list[torch.Tensor]) -> None:
        self.ref_out, self.dirs = ref_out, dirs

    def of(self, target: Target) -> float:
        self.runs += 1
        loss, out = loss_only(self.model, self.inputs, target, self.mode, self.dirs)
        if self.metric == "output":
            return err(out, self.ref_out).value
        return loss_error(loss, self.ref_loss, self.scale)

    def error(self, islands: list[str]) -> float:
        return self.of(self.target.with_islands(islands))


def verifier(
    model: nn.Module, inputs: Inputs, target: Target, ref: Target, mode: str, m: Measurement | None
) -> ErrorOf:
    """An ErrorOf for compare's findings (its measurement's metric; none: the outputs): the
    reference's output and projection from one plain run."""
    from castwise.numerics._compare_run import call_model, projection, seed_all

    errors = ErrorOf(model, inputs, target, mode, m.metric if m is not None else "output", m)
    with raised_in(reference_run(ref), ref.full_policy), torch.no_grad():
        seed_all(0)
        ref_out = call_model(prepared(model, ref, mode), inputs)
    errors.reference(ref_out, projection(ref_out))
    return errors


def reduction(before: float, after: float) -> float:
    """How many times lower ``after`` is than ``before`` (inf: from non-finite to finite, or to 0)."""
    if math.isinf(before) and math.isfinite(after):
        return math.inf
    return before / after if after > 0 else math.inf


@dataclass(frozen=True)
class IslandFix:
    """One island (a ``keep[SELECTOR]=f32`` clause) and what it did to the error, run alone."""

    selector: str
    covers: tuple[str, ...]  # the findings' modules it is the fix for
    before: float
    after: float
    metric: str

    @property
    def reduction(self) -> float:
        return reduction(self.before, self.after)

    @property
    def verified(self) -> bool:
        return self.reduction >= VERIFIED_FACTOR

    def text(self) -> str:
        clause = f"`keep[{self.selector}]=f32`"
        times = "inf" if math.isinf(self.reduction) else f"{self.reduction:.1f}"
        how = f"{self.metric} error {self.before:.2e} -> {self.after:.2e}, {times}x lower, in a re-run with it alone"
        head = f"Add {clause} to the policy (a float32 island)"
        many = f"; one fix for the {len(self.covers)} modules past tolerance" if len(self.covers) > 1 else ""
        if self.verified:
            return f"{head}: verified ({how}){many}."
        return (
            f"{head}: not verified ({how}, under the {VERIFIED_FACTOR:.0f}x asked); no single island brings "
            "the error down: `castwise.tune(model, batch, policy=..., budget=...)` finds the set that does, "
            "or make the op stable (two-pass variance, a larger epsilon, subtract before casting)."
        )


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for segs in zip(*parts, strict=False):
        if len(set(segs)) != 1:
            break
        common.append(segs[0])
    return ".".join(common)


def _candidates(model: nn.Module, flagged: list[ModuleNumerics], called: set[str]) -> list[str]:
    """Island selectors, cheapest first; a parent only where it is called (a ModuleList is not, and
    an island's output is cast back where it returns)."""
    names = [r.module for r in sorted(flagged, key=lambda r: r.order)]
    out = [_literal(names[0])]
    if len(names) > 1:
        classes = {type(model.get_submodule(n)).__name__ for n in names}
        if len(classes) == 1:
            out.append(f"class:{classes.pop()}")
        parent = _common_parent(names)
        if parent and parent not in names and parent in called:
            out.append(_literal(parent))
        out += [_literal(n) for n in names[1:]]
    return out


def island_fixes(errors: ErrorOf, baseline: float, m: Measurement) -> dict[str, IslandFix]:
    """The fix of each module past tolerance, by name: the first island that verifies is the one fix
    of them all; none verified, a module's own island as it measured (untried ones are left out)."""
    flagged = [r for r in m.modules if r.past_tolerance and r.module]
    names = tuple(r.module for r in flagged)
    tried: dict[str, IslandFix] = {}
    for selector in _candidates(errors.model, flagged, {r.module for r in m.modules})[:MAX_RUNS] if names else []:
        island = Target(errors.target.policy.with_rules(ModuleRule(selector, torch.float32)), errors.target.recipe)
        try:
            after = errors.of(island)
        except RunRaised:
            continue  # an island this model cannot run with is no fix
        fix = IslandFix(selector, names, baseline, after, errors.metric)
        if fix.verified:
            return dict.fromkeys(names, fix)
        tried[selector] = IslandFix(selector, (), baseline, after, errors.metric)
    return {n: tried[_literal(n)] for n in names if _literal(n) in tried}
