"""The precision ledger as values (torch-free): one row per parameter group.

A row says, for the parameters it names, what a training step keeps them in: storage, compute,
gradient (``grad_dtype``), reduction, master copy, optimizer state (dtype, scheme: f32, bf16, f16,
8-bit, 4-bit, fp8; rounding: stochastic, kahan, none) and the checkpoint's dtype on save and on
load. A field castwise cannot know is ``unknown``, never guessed. Parameters whose rows are equal
share one row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from castwise._dtypes import short
from castwise.rules.api import Finding

__all__ = ["FIELDS", "UNKNOWN", "Entry", "Ledger", "Row", "group_rows"]

UNKNOWN = "unknown"

# field -> column header
FIELDS: dict[str, str] = {
    "storage": "storage",
    "compute": "compute",
    "gradient": "grad",
    "reduction": "reduce",
    "master": "master",
    "state": "state",
    "scheme": "scheme",
    "rounding": "rounding",
    "checkpoint_save": "ckpt save",
    "checkpoint_load": "ckpt load",
}


@dataclass(frozen=True)
class Entry:
    """One field of a row: a dtype name (``bfloat16``) or a word (``8-bit``, ``none``,
    ``unknown``), where it comes from (a setting, an engine's source, a measurement), and why."""

    value: str = UNKNOWN
    source: str = ""
    note: str = ""

    @property
    def known(self) -> bool:
        return self.value != UNKNOWN

    def show(self) -> str:
        return short(self.value)

    def to_dict(self) -> dict[str, str]:
        return {"value": self.value, "source": self.source, "note": self.note}


@dataclass(frozen=True)
class Row:
    """The ledger of one parameter group (``params``: names, or a description of a group)."""

    params: tuple[str, ...]
    storage: Entry = field(default_factory=Entry)
    compute: Entry = field(default_factory=Entry)
    gradient: Entry = field(default_factory=Entry)
    reduction: Entry = field(default_factory=Entry)
    master: Entry = field(default_factory=Entry)
    state: Entry = field(default_factory=Entry)
    scheme: Entry = field(default_factory=Entry)
    rounding: Entry = field(default_factory=Entry)
    checkpoint_save: Entry = field(default_factory=Entry)
    checkpoint_load: Entry = field(default_factory=Entry)

    def entries(self) -> dict[str, Entry]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "params"}

    def values(self) -> dict[str, str]:
        """Field -> value: what a comparison with an engine's truth reads."""
        return {k: e.value for k, e in self.entries().items()}

    def to_dict(self) -> dict[str, Any]:
        return {"params": list(self.params), **{k: e.to_dict() for k, e in self.entries().items()}}


def group_rows(per_param: Iterable[tuple[str, Mapping[str, Entry]]]) -> tuple[Row, ...]:
    """One row per set of parameters whose entries are equal, in first-seen order."""
    groups: dict[tuple[tuple[str, Entry], ...], list[str]] = {}
    for name, entries in per_param:
        key = tuple(sorted(entries.items()))
        groups.setdefault(key, []).append(name)
    return tuple(Row(tuple(names), **dict(key)) for key, names in groups.items())


def listed(names: Sequence[str], limit: int = 3) -> str:
    """The first ``limit`` names, and how many more (every ledger message and table shortens alike)."""
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f" (+{len(names) - limit} more)"


@dataclass(frozen=True)
class Ledger:
    """Where each parameter group's precision is decided, for one run (a model or configs)."""

    rows: tuple[Row, ...]
    source: str  # what was read: config paths, or the model target and its optimizer
    notes: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()  # CW150/CW151, measured on the model's copy

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
            "findings": [f.to_dict() for f in self.findings],
        }

    def unknown(self) -> int:
        return sum(not e.known for r in self.rows for e in r.entries().values())

    def render(self, width: int = 100) -> str:
        """A table: one line per group, then where each known value comes from."""
        head = ["params", *FIELDS.values()]
        body = [[listed(r.params), *(r.entries()[k].show() for k in FIELDS)] for r in self.rows]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        widths[0] = min(widths[0], max(32, width - sum(widths[1:]) - 2 * len(widths)))
        lines = [f"castwise ledger {self.source}", ""]
        for cells in [head, *body]:
            cut = [c if len(c) <= w else c[: w - 1] + "~" for c, w in zip(cells, widths, strict=True)]
            lines.append("  ".join(c.ljust(w) for c, w in zip(cut, widths, strict=True)).rstrip())
        for i, r in enumerate(self.rows, 1):
            lines += ["", f"group {i}: {listed(r.params, 8)}"]
            for k, e in r.entries().items():
                why = "; ".join(x for x in (e.source, e.note) if x)
                lines.append(f"  {k:<16} {e.show():<10} {why}".rstrip())
        lines += [f"note: {n}" for n in self.notes]
        for f in self.findings:
            lines += ["", f"{f.level} {f.code} {f.rule.name}", f"  {f.message}", f"  fix: {f.fix}"]
        return "\n".join(lines)
