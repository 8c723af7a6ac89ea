"""The shape of an audit rule: its catalog entry, its checks, its policy fix (torch-free).

One module per code in this package, each defining ``RULE = AuditRule(...)``:

- ``meta``: the catalog entry (code, kebab-case name, category, severity, the page).
- ``checks``: event checks. Each reads one refused op (a contract violation or an op that
  raised) as an :class:`castwise.auditor.context.Ctx` and returns a diagnosis or None. The
  audit asks the checks in the order of ``PRECEDENCE`` (rules/audit/__init__.py); the first
  answer wins.
- ``scan``: run-level findings (warnings over all runs, what could not be checked).
- ``policy_fix``: what ``suggested_policy`` adds for a finding of this code.

Rule modules import torch inside their functions only: the catalog (``castwise rules``, and
lint-config's findings) reads ``meta`` without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from castwise.rules._rule import Rule

if TYPE_CHECKING:
    from castwise.auditor.context import Ctx, FixContext, Session
    from castwise.report import Finding
    from castwise.trace.events import Origin


@dataclass(frozen=True)
class Diag:
    """A diagnosis before it becomes a Finding (findings of several modes and places merge)."""

    code: str
    module: str
    op: str | None
    origin: Origin | None
    message: str
    fix: str
    culprit_modules: tuple[str, ...] = ()
    expected: str | None = None
    source: str | None = None  # the user's line where the origin was made ("file.py:42")
    # (file, line, replacement line, original line): the code change where no policy fixes it
    code_fix: tuple[str, int, str, str | None] | None = None
    details: tuple[tuple[str, Any], ...] = ()  # extra JSON fields of the finding (e.g. the hook)


Match = Callable[["Ctx"], "Diag | None"]
Scan = Callable[["Session"], "list[Finding]"]
PolicyFix = Callable[[Any, "Finding", "FixContext"], Any]  # (Policy, finding, context) -> Policy


@dataclass(frozen=True)
class Check:
    """One event check; ``key`` names it in the precedence list (``CW110`` or ``CW110.embedding``)."""

    key: str
    match: Match


@dataclass(frozen=True)
class AuditRule:
    meta: Rule
    checks: tuple[Check, ...] = ()
    scan: Scan | None = None
    policy_fix: PolicyFix | None = None
    # where a check not in PRECEDENCE goes: before this key (default: before the catch-all)
    before: str = "CW110"

    @property
    def code(self) -> str:
        return self.meta.code
