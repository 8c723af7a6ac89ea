"""The diagnostic catalog: one registry, the single source of codes (torch-free).

Like ruff's rule catalog: every diagnosis has a stable code (``CW`` + three digits, never
reused), a kebab-case name for the pattern, a default severity, a root-cause category and one
page (what it detects, why it matters, an example, the fix). ``castwise rules`` lists them,
``castwise rules CODE`` prints a page.

Codes by range: CW1xx audit (dtype flow of a model), CW2xx lint-config (training
configurations), CW9xx the audit's own limits (what it could not check).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from castwise.categories import CATEGORIES

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")

_CODE = re.compile(r"^CW\d{3}$")
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    category: str | None  # one of castwise.categories; None only for non-dtype failures
    severity: Severity
    summary: str  # one line
    detects: str
    why: str
    example: str
    fix: str

    def page(self) -> str:
        """The rule's documentation page, as `castwise rules CODE` prints it."""
        category = self.category or "(not a dtype root cause)"
        return (
            f"{self.code} {self.name}\n"
            f"{'=' * (len(self.code) + 1 + len(self.name))}\n"
            f"{self.summary}\n\n"
            f"severity: {self.severity}    category: {category}\n\n"
            f"What it detects\n---------------\n{self.detects.strip()}\n\n"
            f"Why it matters\n--------------\n{self.why.strip()}\n\n"
            f"Example\n-------\n{self.example.strip()}\n\n"
            f"Fix\n---\n{self.fix.strip()}\n"
        )


def _build() -> dict[str, Rule]:
    from castwise.rules import audit as _audit
    from castwise.rules import lint as _lint
    from castwise.rules import numerics as _numerics

    registry: dict[str, Rule] = {}
    names: set[str] = set()
    for rule in (*_audit.RULES, *_lint.RULES, *_numerics.RULES):
        # a broken catalog is a bug in castwise, not user input: fail loudly at import
        if not _CODE.match(rule.code) or not _NAME.match(rule.name):
            raise RuntimeError(f"malformed rule code/name: {rule.code} {rule.name}")
        if rule.code in registry or rule.name in names:
            raise RuntimeError(f"duplicate rule code or name: {rule.code} {rule.name}")
        if rule.category is not None and rule.category not in CATEGORIES:
            raise RuntimeError(f"{rule.code}: unknown category {rule.category}")
        if rule.severity not in SEVERITIES:
            raise RuntimeError(f"{rule.code}: unknown severity {rule.severity}")
        registry[rule.code] = rule
        names.add(rule.name)
    return dict(sorted(registry.items()))


REGISTRY: dict[str, Rule] = _build()


def get(code_or_name: str) -> Rule:
    """A rule by code (``CW101``, case-insensitive) or by kebab-case name."""
    key = code_or_name.strip()
    rule = REGISTRY.get(key.upper())
    if rule is None:
        rule = next((r for r in REGISTRY.values() if r.name == key.lower()), None)
    if rule is None:
        from castwise.errors import CastwiseError

        raise CastwiseError(
            f"no rule {code_or_name!r}; valid codes: {', '.join(REGISTRY)} "
            "(or a rule's kebab-case name; `castwise rules` lists them)"
        )
    return rule


def all_rules() -> list[Rule]:
    return list(REGISTRY.values())
