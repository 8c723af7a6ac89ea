"""The precision ledger (``Report.extra["ledger"]``, a ``Ledger.to_dict()``) as a short terminal
table: one row per parameter group, as the HTML report's table shows it (torch-free)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from castwise._dtypes import short

__all__ = ["ledger_lines"]

# field -> column header (the ledger's own fields, in its order; "?" stands for unknown)
_HEAD = {"gradient": "grad", "reduction": "reduce", "checkpoint_save": "ckpt save", "checkpoint_load": "ckpt load"}


def _value(entry: Any) -> str:
    value = str(entry.get("value", "unknown")) if isinstance(entry, Mapping) else "unknown"
    return "?" if value == "unknown" else short(value)


def ledger_lines(ledger: Any, width: int) -> list[str]:
    """The table's lines (none without rows): a header, then one line per group, the params cut to
    what the width leaves."""
    rows = ledger.get("rows") if isinstance(ledger, Mapping) else None
    if not rows:
        return []
    fields = [k for k in rows[0] if k != "params"]
    body = []
    for r in rows:
        params = [str(p) for p in r.get("params") or []]
        shown = (params[0] if params else "-") + (f" (+{len(params) - 1})" if len(params) > 1 else "")
        body.append([shown, *(_value(r.get(k)) for k in fields)])
    head = ["params", *(_HEAD.get(k, k) for k in fields)]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    widths[0] = max(16, min(widths[0], width - 2 - sum(w + 2 for w in widths[1:])))
    lines = ["", f"ledger ({ledger.get('source', '')}; ? unknown):"]
    for cells in [head, *body]:
        cut = [c if len(c) <= w else c[: w - 1] + "~" for c, w in zip(cells, widths, strict=True)]
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(cut, widths, strict=True)).rstrip())
    return lines
