"""Findings and reports: plain values (torch-free), their JSON form and terminal rendering.

The JSON shape is part of castwise's public contract (see the README): ``findings``,
``suggested_policy``, ``runs`` and ``summary``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from castwise import rules as _rules
from castwise.rules._rule import Severity
from castwise.trace.events import Mode, Origin, RunKind, RunStatus

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class CodeFix:
    """A one-line code change: in ``file`` at ``line``, the line becomes ``replace``.

    ``verified``: a re-audit with the change simulated (the hook's result cast back, ...) found
    no error; False: not simulated, or the re-audit still found one."""

    file: str
    line: int
    replace: str
    original: str | None = None
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "replace": self.replace,
            "original": self.original,
            "verified": self.verified,
        }

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.replace.strip()}"


@dataclass(frozen=True)
class Finding:
    code: str
    message: str
    module: str | None = None
    op: str | None = None
    origin: Origin | None = None
    modes: tuple[Mode, ...] = ()
    fix: str | None = None
    severity: Severity | None = None  # None: the rule's default (resolved at construction)
    settings: tuple[str, ...] = ()  # lint-config: settings exactly as written
    locations: tuple[str, ...] = ()  # lint-config: "file:line" of each setting
    details: tuple[tuple[str, Any], ...] = ()  # extra JSON fields, e.g. dtypes seen
    source: str | None = None  # "models/rope.py:42": the user's line where the origin was made
    code_fix: CodeFix | None = None  # the code change, where no policy can express the fix

    def __post_init__(self) -> None:
        rule = _rules.get(self.code)  # an unknown code is a bug in castwise: fail here, not at render
        if self.severity is None:
            object.__setattr__(self, "severity", rule.severity)
        elif self.severity not in SEVERITY_ORDER:
            raise ValueError(f"severity {self.severity!r} is not valid; valid: {', '.join(sorted(SEVERITY_ORDER))}")

    @property
    def rule(self) -> _rules.Rule:
        return _rules.get(self.code)

    @property
    def level(self) -> str:
        """The severity (same as ``severity``, which is never None after construction)."""
        return self.severity or self.rule.severity

    def to_dict(self) -> dict[str, Any]:
        rule = self.rule
        out: dict[str, Any] = {
            "code": self.code,
            "name": rule.name,
            "category": rule.category,
            "severity": self.level,
            "module": self.module,
            "op": self.op,
            "origin": self.origin.to_dict() if self.origin else None,
            "modes": list(self.modes),
            "message": self.message,
            "fix": self.fix or rule.fix,
            "source": self.source,
            "code_fix": self.code_fix.to_dict() if self.code_fix else None,
        }
        if self.settings:
            out["settings"] = list(self.settings)
        if self.locations:
            out["locations"] = list(self.locations)
        out.update(dict(self.details))
        return out


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
