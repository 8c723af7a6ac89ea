"""Findings and reports: plain values (torch-free), their JSON form and terminal rendering.

The JSON shape is part of castwise's public contract (see the README): ``findings``,
``suggested_policy``, ``runs`` and ``summary``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from castwise._wrap import wrap
from castwise.report.ledger_text import ledger_lines
from castwise.rules.api import SEVERITY_ORDER, CodeFix, Finding, Mode, Origin
from castwise.trace.events import RunKind, RunStatus


@dataclass(frozen=True)
class Run:
    mode: Mode
    device: str
    policy: str | None
    status: RunStatus  # "incomplete": the run stopped before the end (CW902)
    kind: RunKind = "eager"  # "compiled": the graphs torch.compile runs

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "device": self.device, "policy": self.policy, "status": self.status}
        if self.kind != "eager":
            out["kind"] = self.kind
        return out


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    suggested_policy: Any = None  # castwise.Policy | None (typed loosely: this module is torch-free)
    runs: list[Run] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    title: str = "castwise report"
    extra: dict[str, Any] = field(default_factory=dict)  # more top-level JSON keys, e.g. "units"

    @property
    def ok(self) -> bool:
        """True when no finding is an error and every run was checked to the end: a run that
        stopped early ("incomplete", CW902) left part of the model unchecked, which is never ok."""
        return not any(f.level == "error" for f in self.findings) and not self.incomplete

    @property
    def incomplete(self) -> bool:
        """True when some run stopped before the end of the model (status "incomplete")."""
        return any(r.status == "incomplete" for r in self.runs)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def sorted_findings(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: (SEVERITY_ORDER.get(f.level, 9), f.code))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,  # the JSON shape's version, as `castwise run --json` writes it
            "findings": [f.to_dict() for f in self.sorted_findings()],
            "suggested_policy": None if self.suggested_policy is None else str(self.suggested_policy),
            "runs": [r.to_dict() for r in self.runs],
            "summary": self.summary,
            **self.extra,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        return render_report(self)

    def to_html(self) -> str:
        """The report as one self-contained HTML page (inline CSS/JS/SVG; opens offline)."""
        from castwise.report.html import render_html

        return render_html(self)

    def _repr_html_(self) -> str:
        """What a Jupyter cell shows: the same report, as one scoped ``<div>``."""
        from castwise.report.html import render_fragment

        return render_fragment(self)


# -- the terminal's form: plain text at a given width (100 by default, the CLI passes the
# terminal's); 80 columns read well

WIDTH = 100
_LABEL = 9  # width of the "at", "origin", "fix" labels column


def _field(label: str, text: str, width: int) -> list[str]:
    # a policy, a module path or a code span is never split across lines (castwise._wrap)
    return wrap(" ".join(text.split()), width, f"  {label:<{_LABEL}}", " " * (2 + _LABEL))


def render_finding(f: Finding, width: int = WIDTH) -> list[str]:
    head = f"{f.level} {f.code} {f.rule.name}"
    if f.modes:
        head += f"  [{', '.join(f.modes)}]"
    lines = [head]
    if f.module is not None:
        at = f"`{f.module}`" if f.module else "(model)"
        lines += _field("at", at + (f" in {f.op}" if f.op else ""), width)
    if f.origin is not None:
        origin = str(f.origin) + (f" ({f.source})" if f.source else "")
        lines += _field("origin", origin, width)
    if f.settings:
        lines += _field("settings", ", ".join(f.settings), width)
    for loc in f.locations:
        lines += _field("in", loc, width)
    lines += _field("why", f.message, width)
    lines += _field("fix", f.fix or f.rule.fix, width)
    if f.code_fix is not None:
        checked = "  (verified by a re-audit)" if f.code_fix.verified else ""
        lines += _field("change", f"{f.code_fix.file}:{f.code_fix.line}  {f.code_fix.replace.strip()}{checked}", width)
    return lines


def render_report(report: Report, width: int = WIDTH) -> str:
    counts = {level: sum(f.level == level for f in report.findings) for level in ("error", "warning", "info")}
    tally = ", ".join(f"{n} {level}{'s' if n != 1 else ''}" for level, n in counts.items() if n) or "no findings"
    lines = wrap(f"{report.title}:", width, subsequent_indent="  ")
    if len(lines[-1]) + 1 + len(tally) <= width:  # the tally stays in one piece
        lines[-1] += f" {tally}"
    else:
        lines.append(f"  {tally}")
    if report.runs:
        runs = ", ".join(
            f"{r.mode}{' compiled' if r.kind == 'compiled' else ''} on {r.device}: {r.status}" for r in report.runs
        )
        lines += wrap(f"runs: {runs}", width, subsequent_indent="      ")
    for f in report.sorted_findings():
        lines.append("")
        lines += render_finding(f, width)
    if report.suggested_policy is not None:
        lines.append("")
        lines += wrap(
            f"suggested policy: {report.suggested_policy}  (a re-audit under it finds no error; "
            + (
                "shard with castwise.fsdp2.fully_shard(model, ...))"
                if report.extra.get("units")
                else "apply it with castwise.apply(model, castwise.Policy.parse(...)))"
            ),
            width,
            subsequent_indent="  ",
        )
    units = report.extra.get("units")
    if units:  # a distributed audit: what each FSDP2 unit gathers, computes and reduces in
        lines += ["", "units (stored / gather / compute / reduce / output):"]
        lines += [
            f"  {u['unit']}: {u['stored'] or '-'} / {u['gather']} / {u['compute']} / {u['reduce']} / "
            f"{u['output'] or '-'}  ({u['kind']})"
            for u in units
        ]
    act = report.summary.get("activation_bytes_by_dtype")
    if act:
        total = sum(act.values()) or 1
        share = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(act.items(), key=lambda kv: -kv[1]))
        lines.append("")
        lines += wrap(f"activations by dtype: {share}", width, subsequent_indent="  ")
    lines += _compiled_lines(report.summary.get("compiled") or {}, width)
    lines += ledger_lines(report.extra.get("ledger"), width)
    return "\n".join(lines)


def _compiled_lines(compiled: dict[str, Any], width: int) -> list[str]:
    """What torch.compile did in each compiled run: graphs, graph breaks, its own error."""
    lines: list[str] = []
    for mode, c in compiled.items():
        breaks = c.get("graph_breaks") or []
        head = (
            f"compiled ({mode}): {c.get('graphs', 0)} graph(s), {c.get('backward_graphs', 0)} backward, "
            f"{c.get('ops_checked', 0)} aten ops checked"
            + (" after Inductor's decompositions" if c.get("decompositions") == "inductor" else "")
            + f", {sum(b['count'] for b in breaks)} graph break(s)"
            + (" under fullgraph=True" if c.get("fullgraph") else "")
        )
        lines += ["", *wrap(head, width, subsequent_indent="  ")]
        for b in breaks:
            at = f" at {b['source']}" if b.get("source") else ""
            lines += wrap(f"- break{at}: {b['reason']}", width, subsequent_indent="  ")
        if c.get("backward_untraced"):
            lines += wrap(f"- backward graphs not traced {c['backward_untraced']}", width, subsequent_indent="  ")
        if c.get("error"):
            lines += wrap(f"- torch.compile stopped: {c['error']}", width, subsequent_indent="  ")
    return lines


__all__ = [
    "SEVERITY_ORDER",
    "WIDTH",
    "CodeFix",
    "Finding",
    "Origin",
    "Report",
    "Run",
    "render_finding",
    "render_report",
]
