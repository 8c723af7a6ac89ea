"""``compare(model, inputs, *, policy, reference)``: why is my bf16 loss different from fp32?

The same weights, inputs and random state run under the policy and under the reference, on
real tensors and on copies of the model (the user's model is never touched). Per module:
the error of its output, of the gradient of the loss with respect to its output and of its
parameters' gradients; and the error it *adds* (the module run alone under the policy on the
reference's inputs, its callees answering with the reference's outputs) apart from the error
it *inherits* (already in its inputs). A module is reported only when what it adds is past
what rounding to its format explains (``TOLERANCE_FACTOR`` times the format's unit roundoff),
so a healthy model under bf16-mixed reports nothing. Errors are relative L2 norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from castwise.numerics._compare_core import (
    TOLERANCE_FACTOR,
    Measurement,
    ModuleNumerics,
    measure,
    reference_run,
)
from castwise.numerics._compare_fix import IslandFix, island_fixes, verifier
from castwise.numerics._compare_target import Target, _literal, parse_target
from castwise.numerics._failed import RunRaised, diagnosed
from castwise.numerics._run import check_args
from castwise.numerics.compare_compiled import CompiledComparisonReport, compare_compiled
from castwise.numerics.rows import RowsReport, fmt_err, where
from castwise.report import Finding, Run
from castwise.run import Inputs, RunRequest
from castwise.trace.events import RunStatus, as_mode

TABLE_ROWS = 10  # modules shown in the text report (JSON has all)
EAGER_OF_COMPILED = "eager (the module torch.compile wraps, run without compiling)"


@dataclass
class ComparisonReport(RowsReport):
    """A Report with the per-module numbers (``numerics``) and the loss difference."""

    def __str__(self) -> str:
        lines = [super().__str__(), ""]
        s = self.summary
        if s.get("raised"):
            return "\n".join([*lines, f"no numbers: {s['raised']}"])
        if s.get("metric") == "loss":
            lines.append(
                f"loss (the model's own): reference {s['loss_reference']:.6g}, policy {s['loss_policy']:.6g} "
                f"(relative difference {fmt_err(s['loss_err'])}); output error {fmt_err(s['output_err'])}"
            )
        else:
            lines.append(
                f"output error {fmt_err(s['output_err'])} (the model returns no loss: its outputs are compared; "
                "gradients are of a fixed random projection of them)"
            )
        if s.get("program", "eager") != "eager":
            lines.append(
                f"program compared: {s['program']}; reference='eager' compares the compiled program against it"
            )
        first = s.get("first_past_tolerance")
        lines.append(f"first module past tolerance: {where(first) if first is not None else 'none'}")
        lines.append("")
        head = f"{'module':<44} {'dtype':>8} {'added':>9} {'inherited':>9} {'output':>9} {'grad':>9} {'tol':>9}"
        lines.append(head)
        for row in self.numerics[:TABLE_ROWS]:
            mark = " *" if row["past_tolerance"] else ""
            name = row["module"] or "(model)"
            name = name if len(name) <= 44 else "..." + name[-41:]
            cells = [_cell(row[k]) for k in ("added_err", "inherited_err", "out_err", "grad_err", "tolerance")]
            lines.append(f"{name:<44} {row['dtype']:>8} " + " ".join(f"{c:>9}" for c in cells) + mark)
        if len(self.numerics) > TABLE_ROWS:
            lines.append(f"... {len(self.numerics) - TABLE_ROWS} more modules in to_dict()['numerics']")
        lines.append("(* past tolerance; errors are relative L2 norms against the reference)")
        return "\n".join(lines)


def _cell(x: Any) -> str:
    if x is None:
        return "-"
    if x == "inf":
        return "inf"
    return f"{float(x):.2e}"


def _own_island(name: str) -> str:
    return (
        f"Keep the module in float32: add `keep[{_literal(name)}]=f32` to the policy (not verified: no re-run "
        "with it alone); or let `castwise.tune(model, batch, policy=..., budget=...)` choose the islands."
    )


def _fix(row: ModuleNumerics, fixes: dict[str, IslandFix]) -> tuple[str | None, tuple[tuple[str, Any], ...]]:
    """The finding's fix text (the module named) and what its re-run measured."""
    if not row.module:
        return None, ()
    fix = fixes.get(row.module)
    if fix is None:
        return _own_island(row.module), ()
    reduction = "inf" if math.isinf(fix.reduction) else float(f"{fix.reduction:.4g}")
    return fix.text(), (("fix_island", fix.selector), ("fix_verified", fix.verified), ("error_reduction", reduction))


def _findings(m: Measurement, mode: str, fixes: dict[str, IslandFix] | None = None) -> list[Finding]:
    out: list[Finding] = []
    fixes = fixes or {}
    first = m.first_past_tolerance()
    for rank, row in enumerate(m.modules):
        if not row.past_tolerance:
            continue
        fix, measured = _fix(row, fixes)
        details: tuple[tuple[str, Any], ...] = (
            ("added_err", row.to_dict()["added_err"]),
            ("tolerance", row.to_dict()["tolerance"]),
            ("rank", rank + 1),
            ("first", row is first),
            *measured,
        )
        if math.isinf(row.added_err):
            out.append(
                Finding(
                    "CW321",
                    f"{where(row.module)} makes inf/nan under the policy from the reference's finite "
                    f"inputs ({row.dtype}): the non-finite values start here, they are not inherited.",
                    module=row.module,
                    modes=(as_mode(mode),),
                    details=details,
                    fix=fix,
                )
            )
            continue
        share = "" if row.inherited_err <= 0 else f"; its inputs already carry {row.inherited_err:.2e} (inherited)"
        out.append(
            Finding(
                "CW320",
                f"{where(row.module)} adds relative error {row.added_err:.2e} on its own, "
                f"{row.added_err / row.tolerance:.0f}x what rounding to {row.dtype} explains "
                f"({row.tolerance:.2e}){share}; ranked {rank + 1} of {len(m.modules)} by added error"
                + (", and the first past tolerance in the run." if row is first else "."),
                module=row.module,
                modes=(as_mode(mode),),
                details=details,
                fix=fix,
            )
        )
    return out


def report_of(
    m: Measurement,
    target: Target,
    reference: Target,
    mode: str,
    device: str = "cpu",
    fixes: dict[str, IslandFix] | None = None,
) -> ComparisonReport:
    first = m.first_past_tolerance()
    summary = {
        "reference": str(reference),
        "policy": str(target),
        "mode": mode,
        "metric": m.metric,
        # the model's own loss only: a random projection of its outputs is not called a loss
        "loss_reference": m.loss_ref if m.has_loss else None,
        "loss_policy": m.loss_low if m.has_loss else None,
        "loss_err": m.loss_err if m.has_loss else None,
        "output_err": m.output_err,
        "tolerance_factor": TOLERANCE_FACTOR,
        "first_past_tolerance": None if first is None else first.module,
        "ranked": [row.module for row in m.modules[:TABLE_ROWS]],
    }
    runs = [Run(as_mode(mode), device, str(reference), "ok"), Run(as_mode(mode), device, str(target), "ok")]
    return ComparisonReport(
        findings=_findings(m, mode, fixes),
        runs=runs,
        summary=summary,
        title=f"castwise numerics --compare (real tensors, policy {target}, reference {reference})",
        numerics=[row.to_dict() for row in m.modules],
    )


def compare(
    model: Any, inputs: Any, *, policy: Any, reference: Any = "32-true", mode: str = "train"
) -> ComparisonReport | CompiledComparisonReport:
    """Per-module error of ``policy`` against ``reference`` on real tensors, added vs inherited.

    ``policy``/``reference``: a ``castwise.Policy`` or any string ``Policy.parse`` accepts; the
    float8 GEMMs of a float8 recipe (``fp8``, ``mxfp8``, ``float8_e4m3fn``...) are emulated.
    ``mode``: ``"train"`` (forward and backward of the model's loss, or of a fixed random
    projection of its outputs) or
    ``"eval"`` (forward under no_grad). The model is not changed: both runs use deep copies.
    A ``torch.compile``'d model is compared as the eager module it wraps (``summary["program"]``);
    ``reference="eager"`` compares its compiled program against that eager one under ``policy``
    (``castwise.numerics.compare_compiled``).
    """
    from castwise._compiled import compiled_parts, uncompiled
    from castwise.auditor import preserved_state

    request = check_args("compare", model, inputs, None, None, mode)
    if isinstance(reference, str) and reference.strip().lower() == "eager":
        return compare_compiled(model, request.inputs, policy=policy, mode=mode)
    target, ref = parse_target(policy), parse_target(reference)
    # a compiled model: its policy's program is compared as the eager module it wraps (hooks on
    # modules inside a compiled graph would change what it fuses); the report says so
    was_compiled = compiled_parts(model) is not None
    request = replace(request, model=uncompiled(model))
    device = request.torch_device
    try:
        with preserved_state():
            m = measure(request.model, request.inputs, target, ref, mode)
            fixes = _verified_fixes(request.model, request.inputs, target, ref, mode, m)
    except RunRaised as raised:
        report = raised_report(request, raised, target, ref, device)
    else:
        report = report_of(m, target, ref, mode, device, fixes)
    report.summary["program"] = EAGER_OF_COMPILED if was_compiled else "eager"
    return report


def _verified_fixes(
    model: Any, inputs: Inputs, target: Target, ref: Target, mode: str, m: Measurement
) -> dict[str, IslandFix]:
    """Each past-tolerance module's island, verified by re-running the policy with it alone."""
    if not any(row.past_tolerance and row.module for row in m.modules):
        return {}
    errors = verifier(model, inputs, target, ref, mode, m)
    return island_fixes(errors, m.loss_err if m.has_loss else m.output_err, m)


def raised_report(
    request: RunRequest, raised: RunRaised, target: Target, reference: Target, device: str
) -> ComparisonReport:
    """The report of a comparison the model could not run: the audit's findings for the run that
    raised, no numbers."""
    findings = diagnosed(request, raised)
    mode = request.mode
    ref_failed = raised.run == reference_run(reference)
    status: list[RunStatus] = ["error", "incomplete"] if ref_failed else ["ok", "error"]
    summary: dict[str, Any] = {
        "reference": str(reference),
        "policy": str(target),
        "mode": mode,
        "metric": None,
        "loss_reference": None,
        "loss_policy": None,
        "loss_err": None,
        "output_err": None,
        "raised": str(raised),
        "first_past_tolerance": None,
        "ranked": [],
    }
    runs = [Run(as_mode(mode), device, str(reference), status[0]), Run(as_mode(mode), device, str(target), status[1])]
    title = f"castwise numerics --compare (real tensors, policy {target}, reference {reference})"
    return ComparisonReport(findings=findings, runs=runs, summary=summary, title=title)


__all__ = ["ComparisonReport", "CompiledComparisonReport", "ModuleNumerics", "compare"]
