"""The catalog entry of one rule (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
