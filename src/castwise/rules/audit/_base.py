"""The shape of an audit rule: its catalog entry, its checks, its policy fix (torch-free).

One module per code in this package, each defining ``RULE = AuditRule(...)``:

- ``meta``: the catalog entry (code, kebab-case name, category, severity, the page).
- ``checks``: event checks. Each reads one refused op (a contract violation or an op that
  raised) as a :class:`castwise.rules.api.Ctx` and returns a diagnosis or None. The
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
from typing import Any

from castwise.rules._rule import Rule
from castwise.rules.api import Ctx, Diag, Finding, FixContext, Session

__all__ = ["AuditRule", "Check", "Diag", "Match", "PolicyFix", "Scan"]

Match = Callable[[Ctx], Diag | None]
Scan = Callable[[Session], list[Finding]]
PolicyFix = Callable[[Any, Finding, FixContext], Any]  # (Policy, finding, context) -> Policy


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
