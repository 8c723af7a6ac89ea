"""Findings and reports: plain values (torch-free), their JSON form and terminal rendering.

The JSON shape is part of castwise's public contract (see the README): ``findings``,
``suggested_policy``, ``runs`` and ``summary``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

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
        from castwise.report.text import render_report

        return render_report(self)

    def to_html(self) -> str:
        """The report as one self-contained HTML page (inline CSS/JS/SVG; opens offline)."""
        from castwise.report.html import render_html

        return render_html(self)

    def _repr_html_(self) -> str:
        """What a Jupyter cell shows: the same report, as one scoped ``<div>``."""
        from castwise.report.html import render_fragment

        return render_fragment(self)


__all__ = ["SEVERITY_ORDER", "CodeFix", "Finding", "Origin", "Report", "Run"]
