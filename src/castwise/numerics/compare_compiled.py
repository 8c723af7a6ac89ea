"""``compare(torch.compile(model), inputs, policy=..., reference="eager")``: the compiled
program against the eager one, per module, both against float32 (see ``_compare_compiled``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from castwise.errors import CastwiseError
from castwise.numerics._compare_compiled import CompiledMeasurement, CompiledRow, measure_compiled
from castwise.numerics._compare_core import TOLERANCE_FACTOR
from castwise.numerics._compare_target import parse_target
from castwise.numerics._failed import RunRaised, diagnosed
from castwise.numerics._run import check_args
from castwise.numerics.rows import RowsReport, fmt_err, where
from castwise.report import Finding, Run
from castwise.run import RunRequest
from castwise.trace.events import Mode, as_mode

PROGRAM = "compiled (Inductor) against eager, both under the policy"


@dataclass
class CompiledComparisonReport(RowsReport):
    """compare's report for ``reference="eager"``: ``numerics`` has one row per module compiled."""

    def __str__(self) -> str:
        s = self.summary
        lines = [super().__str__(), "", f"program compared: {s['program']}"]
        if "raised" in s:  # no numbers: the findings above say where the model's own run raised
            return "\n".join(lines)
        lines.append(
            f"whole model: compiled vs eager {fmt_err(s['output_err'])} (tolerance {fmt_err(s['output_tolerance'])}); "
            f"{s['compiles']} compiles"
        )
        first = s["first_divergent"]
        if first is None:
            lines.append("first module where compiled and eager diverge: none")
        else:
            closes = {True: "closes the gap", False: "does not close the gap", None: "could not be tried"}
            lines.append(f"first module where compiled and eager diverge: {where(first)}")
            lines.append(f"emulate_precision_casts=True there: {closes[s['emulate_precision_casts_closes']]}")
        lines.append("")
        lines.append(f"{'module':<40} {'dtype':>6} {'cmp~eager':>9} {'eager~f32':>9} {'cmp~f32':>9} {'tol':>9}")
        for row in self.numerics:
            name = row["module"] or "(model)"
            name = name if len(name) <= 40 else "..." + name[-37:]
            cells = [fmt_err(row[k]) for k in ("compiled_vs_eager", "eager_vs_f32", "compiled_vs_f32", "tolerance")]
            mark = " *" if row["past_tolerance"] else (" (not compiled alone)" if row["error"] else "")
            lines.append(f"{name:<40} {row['dtype']:>6} " + " ".join(f"{c:>9}" for c in cells) + mark)
        lines.append(
            "(* compiled diverges from eager past tolerance; modules compiled alone on the eager run's inputs)"
        )
        return "\n".join(lines)


def _finding(row: CompiledRow, mode: Mode) -> Finding:
    closes = row.emulated_err is not None and row.emulated_err <= row.tolerance
    if row.emulated_err is None:
        emulate = "compiling it with emulate_precision_casts=True could not be tried"
    elif closes:
        emulate = (
            f"with torch._inductor.config.emulate_precision_casts=True the gap closes ({row.emulated_err:.2e}): "
            "Inductor kept intermediates in float32 where eager rounds each op to " + row.dtype
        )
    else:
        emulate = f"emulate_precision_casts=True does not close it ({fmt_err(row.emulated_err)})"
    size = "inf/nan in one program only" if math.isinf(row.compiled_err) else f"relative error {row.compiled_err:.2e}"
    return Finding(
        "CW322",
        f"{where(row.module)} compiled by Inductor differs from its eager run on the same inputs: {size}, "
        f"past the {row.dtype} tolerance ({row.tolerance:.2e}); the first module where the programs diverge; "
        f"{emulate}.",
        module=row.module,
        modes=(mode,),
        details=(("compiled_vs_eager", row.to_dict()["compiled_vs_eager"]), ("emulate_closes", closes)),
    )


def report_compiled(m: CompiledMeasurement, policy: str, mode: str) -> CompiledComparisonReport:
    run_mode = as_mode(mode)
    whole = m.rows[0] if m.rows else None
    first = m.first
    summary: dict[str, Any] = {
        "reference": "eager",
        "policy": policy,
        "mode": mode,
        "program": PROGRAM,
        "output_err": None if whole is None else whole.to_dict()["compiled_vs_eager"],
        "output_tolerance": None if whole is None else whole.tolerance,
        "tolerance_factor": TOLERANCE_FACTOR,
        "first_divergent": None if first is None else first.module,
        "emulate_precision_casts_closes": (
            None if first is None or first.emulated_err is None else first.emulated_err <= first.tolerance
        ),
        "compiles": m.compiles,
    }
    runs = [Run(run_mode, "cpu", f"{policy} (eager)", "ok"), Run(run_mode, "cpu", f"{policy} (compiled)", "ok")]
    return CompiledComparisonReport(
        findings=[] if first is None else [_finding(first, run_mode)],
        runs=runs,
        summary=summary,
        title=f"castwise numerics --compare (real tensors, policy {policy}, compiled against eager)",
        numerics=[row.to_dict() for row in m.rows],
    )


def compare_compiled(model: Any, inputs: Any, *, policy: Any, mode: str = "train") -> CompiledComparisonReport:
    """``model`` (a ``torch.compile``'d module) compiled against eager under ``policy``, per module.

    Forward only (under no_grad; ``mode`` sets train/eval behaviour of the copies' modules).
    """
    from castwise._compiled import compiled_parts, uncompiled
    from castwise._state import preserved_state

    parts = compiled_parts(model)
    if parts is None:
        raise CastwiseError(
            f"reference='eager' compares a compiled model's program against its eager one, and "
            f"{type(model).__name__} is not compiled; pass torch.compile(model) "
            "(compare(torch.compile(model), inputs, policy='bf16-true', reference='eager')), or a policy "
            "string as reference (e.g. '32-true') to compare against float32"
        )
    target = parse_target(policy)
    if target.float8 is not None:
        raise CastwiseError(
            f"reference='eager' compiles the policy's program; emulated float8 ({target}) is not compiled. "
            "Valid: a policy without float8 (bf16-true, bf16-mixed, 16-true, 16-mixed, ...)"
        )
    request = check_args("compare", uncompiled(parts[0]), inputs, None, None, mode)
    try:
        with preserved_state():
            m = measure_compiled(request.model, parts[1], request.inputs, target, mode)
    except RunRaised as raised:  # the model's own error: the audit's diagnosis, no numbers
        return _raised(request, raised, str(target))
    return report_compiled(m, str(target), mode)


def _raised(request: RunRequest, raised: RunRaised, policy: str) -> CompiledComparisonReport:
    """The report of a comparison whose eager or float32 run raised: the audit's findings for that
    run, the compiled program never run."""
    mode = request.mode
    run_mode = as_mode(mode)
    eager_failed = raised.run.startswith("the eager run")
    runs = [
        Run(run_mode, "cpu", f"{policy} (eager)", "error" if eager_failed else "incomplete"),
        Run(run_mode, "cpu", f"{policy} (compiled)", "incomplete"),
    ]
    summary: dict[str, Any] = {
        "reference": "eager",
        "policy": policy,
        "mode": mode,
        "program": PROGRAM,
        "first_divergent": None,
        "raised": str(raised),
        "compiles": 0,
    }
    return CompiledComparisonReport(
        findings=diagnosed(request, raised),
        runs=runs,
        summary=summary,
        title=f"castwise numerics --compare (real tensors, policy {policy}, compiled against eager)",
    )


__all__ = ["CompiledComparisonReport", "compare_compiled"]
