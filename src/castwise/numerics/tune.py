"""``tune(model, inputs, *, policy, budget)``: which layers must stay in float32?

Aims at the smallest set of float32 islands, by FLOPs, under which the error against the reference
is within ``budget``. One compare measurement ranks the candidates (every module that adds
error under the policy; those past tolerance first) by sensitivity: the error a module adds
alone, weighted by the loss gradient at its output, as ModelOpt's AutoQuantize scores layers.
Then a verified search, greedy with bisection: the measurement itself is the run without
islands, one run tries the modules past tolerance, bisection finds the shortest prefix of the
ranking whose real run meets the budget (at most 3 + ceil(log2(candidates)) runs, usually
2 + ceil(log2(modules past tolerance))); then, while runs are left under 2 + log2(modules),
islands are dropped greedily, most FLOPs first, when a real run without them still meets the
budget. Islands are ``keep[NAME]=f32`` rules: weights float32,
inputs cast in, autocast off inside, output cast back saturating to float16's range.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise.errors import CastwiseError
from castwise.numerics._compare_core import (
    Measurement,
    ModuleNumerics,
    measure,
    reference_run,
)
from castwise.numerics._compare_fix import ErrorOf
from castwise.numerics._compare_run import call_model, projection, seed_all
from castwise.numerics._compare_target import Target, parse_target, prepared
from castwise.numerics._failed import RunRaised, diagnosed, raised_in
from castwise.numerics._run import check_args
from castwise.numerics.silent import silent_islands
from castwise.report import Finding
from castwise.run import Inputs

METRICS = ("loss", "output")


@dataclass(frozen=True)
class Tuned:
    """What tune found: ``policy`` (with the islands), its verified ``error`` and the share of
    forward FLOPs left in low precision."""

    policy: Any  # castwise.Policy; a str for an emulated float8 target ("float8_e4m3fn,keep[...]=f32")
    error: float  # the metric's relative error under `policy`, from a real run
    low_precision_share: float  # forward matmul/conv FLOPs outside float32 islands / all
    islands: tuple[str, ...]
    budget: float
    metric: str
    met: bool  # error <= budget
    baseline_error: float  # the error with no islands
    runs: int  # real runs of the policy the search made (the measurement included)
    candidates: tuple[str, ...]  # ranked by sensitivity, most sensitive first
    reference: str = "32-true"
    island_share: float = 0.0  # forward FLOPs in the islands tune added / all (the policy's own excluded)
    raised: tuple[Finding, ...] = ()  # the model raised in a run: the audit's findings, no search

    @classmethod
    def failed(cls, findings: list[Finding], target: Target, ref: Target, budget: float, metric: str) -> Tuned:
        """What tune says when the model raised in one of its runs: the findings, nothing met."""
        return cls(
            str(target), math.inf, 0.0, (), budget, metric, False, math.inf, 0, (), str(ref), raised=tuple(findings)
        )

    @property
    def ok(self) -> bool:
        return self.met

    @property
    def findings(self) -> list[Finding]:
        if self.raised:
            return list(self.raised)
        share = f"{100 * self.low_precision_share:.1f}% of FLOPs in low precision"
        if not self.met:
            return [
                Finding(
                    "CW330",
                    f"with {len(self.islands)} float32 islands ({share}) the {self.metric} "
                    f"still differs from {self.reference} by {self.error:.2e}, past the budget "
                    f"{self.budget:.2e} (no islands: {self.baseline_error:.2e}).",
                    details=(("islands", list(self.islands)),),
                )
            ]
        return [
            Finding(
                "CW331",
                f"policy {self.policy}: {len(self.islands)} float32 island(s), {share}; "
                f"{self.metric} error {self.error:.2e} within the budget {self.budget:.2e} "
                f"(no islands: {self.baseline_error:.2e}), verified by a real run; "
                f"{self.runs} runs.",
                fix=f"castwise.apply(model, Policy.parse({str(self.policy)!r}))",
                details=(("islands", list(self.islands)),),
            )
        ]

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | str:
            return "inf" if math.isinf(x) else float(f"{x:.6g}")

        return {
            "policy": str(self.policy),
            "error": num(self.error),
            "metric": self.metric,
            "budget": self.budget,
            "met": self.met,
            "low_precision_share": round(self.low_precision_share, 6),
            "island_share": round(self.island_share, 6),
            "islands": list(self.islands),
            "baseline_error": num(self.baseline_error),
            "runs": self.runs,
            "candidates": list(self.candidates),
            "reference": self.reference,
            "findings": [f.to_dict() for f in self.findings],
        }

    def to_json(self) -> str:
        """``to_dict()`` as JSON, as ``Report.to_json`` writes it (the CLI's ``--json``)."""
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        from castwise.report import render_finding

        if self.raised:
            head = f"castwise numerics --tune: nothing searched, the model raised (policy {self.policy})"
            return "\n".join([head, *(x for f in self.raised for x in ["", *render_finding(f)])])
        verdict = "within" if self.met else "NOT within"
        lines = [
            f"castwise numerics --tune: {self.metric} error {self.error:.2e} {verdict} the budget "
            f"{self.budget:.2e} (no islands: {self.baseline_error:.2e}; {self.runs} real runs)",
            f"policy: {self.policy}",
            f"float32 islands ({len(self.islands)}): {', '.join(self.islands) or 'none'}",
            f"low-precision share of FLOPs: {100 * self.low_precision_share:.1f}% (the islands above: "
            f"{100 * self.island_share:.1f}%)",
        ]
        for f in self.findings:
            lines += ["", *render_finding(f)]
        return "\n".join(lines)


def _forward_flops(model: nn.Module, inputs: Inputs) -> dict[str, int]:
    """Forward FLOPs (matmuls, convolutions, attention) per module name, children included."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        call_model(model, inputs)
    root = type(model).__name__
    out: dict[str, int] = {}
    for key, counts in counter.get_flop_counts().items():
        if key == "Global":
            continue
        name = "" if key == root else key.removeprefix(root + ".")
        out[name] = int(sum(counts.values()))
    return out


def _covered(name: str, islands: list[str]) -> bool:
    return any(name == k or name.startswith(k + ".") for k in islands)


def _union(names: list[str]) -> list[str]:
    """Outermost names only (an island's descendants are in it already)."""
    out: list[str] = []
    for name in sorted(set(names), key=lambda n: n.count(".")):
        if not _covered(name, out):
            out.append(name)
    return out


def _total(flops: dict[str, int]) -> int:
    return flops.get("", 0) or sum(v for k, v in flops.items() if "." not in k)


def _island_share(flops: dict[str, int], islands: list[str]) -> float:
    total = _total(flops)
    return sum(flops.get(n, 0) for n in _union(islands)) / total if total > 0 else 0.0


def _share(flops: dict[str, int], target: Target, islands: list[str], low_model: nn.Module) -> float:
    """Forward FLOPs left in low precision: outside the tuned islands and the policy's own."""
    total = _total(flops)
    if total <= 0:
        return 1.0
    from castwise.policy import resolve

    kept = [n for n, d in resolve(target.policy, low_model).items() if d.island == torch.float32]
    if target.float8 is not None:
        low = [n for n, m in low_model.named_modules() if getattr(m, "_castwise_float8", None) is not None]
        return sum(flops.get(n, 0) for n in low if not _covered(n, islands + kept)) / total
    outer = _union(islands + kept)
    return max(0.0, 1.0 - sum(flops.get(n, 0) for n in outer) / total)


def _candidates(m: Measurement, flops: dict[str, int]) -> list[ModuleNumerics]:
    """Modules that add error: those past tolerance first, each group most sensitive first and
    the cheaper first among equals (the model itself is not an island)."""
    rows = [r for r in m.modules if r.module and r.added_err > 0]

    def key(r: ModuleNumerics) -> tuple[bool, float, float, int]:
        sens = 1e308 if math.isinf(r.sensitivity) or math.isnan(r.sensitivity) else r.sensitivity
        return (not r.past_tolerance, -sens, flops.get(r.module, 0), r.order)

    return sorted(rows, key=key)


def _bisect(
    search: ErrorOf, ordered: list[ModuleNumerics], baseline: float, budget: float, seeded: int = 0
) -> tuple[list[str], float]:
    """The shortest prefix of the ranking whose real run meets the budget (or the best seen);
    the first ``seeded`` (the silent findings' islands) are the first prefix tried."""
    ranked = [r.module for r in ordered]
    prefix = [_union(ranked[:k]) for k in range(len(ranked) + 1)]
    errors: dict[int, float] = {0: baseline}

    def passes(k: int) -> bool:
        if k not in errors:
            errors[k] = search.error(prefix[k])
        return errors[k] <= budget

    def bisect(lo: int, hi: int) -> int:  # prefix lo fails, prefix hi passes
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if passes(mid) else (mid, hi)
        return hi

    best = 0
    if baseline > budget and ranked:
        # the modules past tolerance first: usually they are the islands, and one run says so
        past = sum(r.past_tolerance for r in ordered)
        first = seeded or (past if 0 < past < len(ranked) else len(ranked))
        if passes(first):
            best = bisect(0, first)
        elif first < len(ranked) and passes(len(ranked)):
            best = bisect(first, len(ranked))
        else:
            best = min(errors, key=lambda k: (errors[k], k))
    return prefix[best], errors[best]


def _prune(
    search: ErrorOf, islands: list[str], error: float, budget: float, flops: dict[str, int], limit: int
) -> tuple[list[str], float]:
    """Greedy, while runs are left under ``limit``: drop the most expensive island when a real
    run without it still meets the budget (fewer float32 FLOPs, verified)."""
    kept = list(islands)
    for name in sorted(islands, key=lambda n: -flops.get(n, 0)):
        if search.runs >= limit or len(kept) == 1:
            break
        trial = [k for k in kept if k != name]
        trial_error = search.error(trial)
        if trial_error <= budget:
            kept, error = trial, trial_error
    return kept, error


def _check(budget: float, metric: str) -> None:
    if metric not in METRICS:
        raise CastwiseError(f"metric={metric!r} is not valid; valid: {', '.join(sorted(METRICS))}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (0 < budget < math.inf):
        raise CastwiseError(
            f"budget={budget!r} is not valid; valid: a relative error > 0, e.g. 1e-2 "
            "(the loss may differ from the reference's by 1%)"
        )


def tune(
    model: Any,
    inputs: Any,
    *,
    policy: Any,
    budget: float,
    metric: str = "loss",
    mode: str = "train",
    reference: Any = "32-true",
) -> Tuned:
    """Few float32 islands, few FLOPs, under which ``metric`` is within ``budget`` (verified):
    the shortest prefix of the sensitivity ranking that meets it, then islands dropped greedily,
    most FLOPs first, while a run without them still meets it and runs are left (at most
    2 + log2(modules) in all).

    ``metric``: ``"loss"`` (relative difference of the model's own loss: a ``loss`` field of its
    output or a scalar output; a model that returns none is measured by its outputs, and
    ``Tuned.metric`` says "output") or ``"output"`` (relative L2 error of the outputs).
    ``policy``: bf16/f16 policies, or an emulated float8 format (``float8_e4m3fn``). The model is
    not changed: every run is on a deep copy.
    """
    from castwise.auditor import preserved_state

    _check(budget, metric)
    request = check_args("tune", model, inputs, None, None, mode)
    target, ref = parse_target(policy), parse_target(reference)
    try:
        with preserved_state():
            return _tune(model, request.inputs, target, ref, float(budget), metric, mode)
    except RunRaised as raised:
        return Tuned.failed(diagnosed(request, raised), target, ref, float(budget), metric)


def _tune(
    model: nn.Module, inputs: Inputs, target: Target, ref: Target, budget: float, metric: str, mode: str
) -> Tuned:
    ref_model = prepared(model, ref, mode)
    with raised_in(reference_run(ref), ref.full_policy):
        flops = _forward_flops(ref_model, inputs)
        seed_all(0)
        with torch.no_grad():
            ref_out = call_model(ref_model, inputs)
    dirs = projection(ref_out)
    m = measure(model, inputs, target, ref, mode)
    if metric == "loss" and not m.has_loss:
        metric = "output"  # no loss of its own: its outputs are what it gives, not a projection of them
    search = ErrorOf(model, inputs, target, mode, metric, m)
    search.reference(ref_out, dirs)
    search.runs = 1  # the measurement's run of the policy is the run without islands
    baseline = m.loss_err if metric == "loss" else m.output_err
    # the silent findings' islands (a router, a rotary table kept float32) first: tried before the rest
    seeds = set(silent_islands(model, inputs, target.full_policy, mode)) if target.recipe is None else set()
    ordered = sorted(_candidates(m, flops), key=lambda r: r.module not in seeds)
    ranked = [r.module for r in ordered]
    islands, error = _bisect(search, ordered, baseline, budget, sum(r.module in seeds for r in ordered))
    if error <= budget and len(islands) > 1:
        limit = int(2 + math.log2(len(list(model.modules()))))
        islands, error = _prune(search, islands, error, budget, flops, limit)
    low_model = prepared(model, target.with_islands(islands), mode)
    found = target.with_islands(islands)
    return Tuned(
        policy=found.policy if found.float8 is None else str(found),
        error=error,
        low_precision_share=_share(flops, target, islands, low_model),
        island_share=_island_share(flops, islands),
        islands=tuple(islands),
        budget=budget,
        metric=metric,
        met=error <= budget,
        baseline_error=baseline,
        runs=search.runs,
        candidates=tuple(ranked),
        reference=str(ref),
    )


__all__ = ["Tuned", "tune"]
