"""The catalog entry of one rule (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from castwise import _wrap

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")


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

    def page(self, width: int = 100) -> str:
        """The rule's documentation page, as `castwise rules CODE` prints it: prose wrapped at
        ``width`` columns, the example verbatim (it is code)."""

        def fill(text: str) -> str:
            return _wrap.fill(" ".join(text.split()), width)

        category = self.category or "(not a dtype root cause)"
        return (
            f"{self.code} {self.name}\n"
            f"{'=' * (len(self.code) + 1 + len(self.name))}\n"
            f"{fill(self.summary)}\n\n"
            f"severity: {self.severity}    category: {category}\n\n"
            f"What it detects\n---------------\n{fill(self.detects)}\n\n"
            f"Why it matters\n--------------\n{fill(self.why)}\n\n"
            f"Example\n-------\n{self.example.strip()}\n\n"
            f"Fix\n---\n{fill(self.fix)}\n"
        )


# code -> entry: filled by the catalog (castwise.rules, which imports every rule module) as it loads
REGISTRY: dict[str, Rule] = {}


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
