"""The HTML report's numerics section: per-module error and range, as charts and a table.

It reads ``to_dict()["numerics"]``: one dict per module (model order) with ``"module"`` and
numbers such as ``absmax``, ``margin_pow2`` (log2 of the dtype's largest value over absmax),
``out_err`` (error of the module's output against float32), ``added_err`` (the part this module
added), ``tolerance``, and optionally ``dtype`` and ``nonfinite``/``first_nonfinite``. Missing
numbers leave a chart out; non-finite values are drawn full width and marked bad.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from castwise.report._svg import Bar, bar_chart, fmt_number

# the largest finite value of each dtype, by every name a numerics entry may use
DTYPE_MAX: dict[str, float] = {
    "f16": 65504.0,
    "float16": 65504.0,
    "bf16": 3.3895313892515355e38,
    "bfloat16": 3.3895313892515355e38,
    "f32": 3.4028234663852886e38,
    "float32": 3.4028234663852886e38,
    "f8e4m3fn": 448.0,
    "float8_e4m3fn": 448.0,
    "f8e5m2": 57344.0,
    "float8_e5m2": 57344.0,
}
MAX_BARS = 120  # per chart; the table below it lists every module
_TIGHT_MARGIN = 2.0  # log2 margin under which a module is close to overflow


def number(value: Any) -> float | None:
    """A float from a JSON value; "inf"/"nan" strings (JSON has no infinities) too."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf", "nan", "infinity", "-infinity"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return None


def _nonfinite(entry: dict[str, Any]) -> bool:
    if entry.get("nonfinite") or entry.get("first_nonfinite"):
        return True
    return any((v := number(entry.get(k))) is not None and not math.isfinite(v) for k in ("absmax", "out_err"))


def first_nonfinite(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The entry marked ``first_nonfinite``, else the first (model order) with a non-finite value."""
    marked = [e for e in entries if e.get("first_nonfinite")]
    return marked[0] if marked else next((e for e in entries if _nonfinite(e)), None)


def _pick(entries: list[dict[str, Any]], key: Any) -> tuple[list[dict[str, Any]], str]:
    """At most MAX_BARS entries, the worst by ``key``, kept in model order."""
    if len(entries) <= MAX_BARS:
        return entries, ""
    worst = sorted(range(len(entries)), key=lambda i: key(entries[i]))[:MAX_BARS]
    return [entries[i] for i in sorted(worst)], f" (the {MAX_BARS} worst of {len(entries)}, in model order)"


def _error_chart(entries: list[dict[str, Any]], first: str | None) -> str:
    rows = [e for e in entries if number(e.get("out_err")) is not None]
    if not rows:
        return ""

    def ratio(e: dict[str, Any]) -> float:
        err, tol = number(e.get("out_err")) or 0.0, number(e.get("tolerance"))
        return -(err / tol if tol else err) if math.isfinite(err) else -math.inf

    rows, note = _pick(rows, ratio)
    bars = []
    for e in rows:
        err = number(e.get("out_err")) or 0.0
        tol, added = number(e.get("tolerance")), number(e.get("added_err"))
        over = tol is not None and (err > tol or not math.isfinite(err))
        kind = "bad" if over or e["module"] == first else "ok"
        text = f"{fmt_number(err)}" + (f" / tol {fmt_number(tol)}" if tol is not None else "")
        tip = (
            f"{e['module']}: output error {fmt_number(err)}"
            + (f", added here {fmt_number(added)}" if added is not None else "")
            + (f", tolerance {fmt_number(tol)}" if tol is not None else "")
        )
        bars.append(Bar(e["module"], err, text, kind, marker=tol, inner=added, tip=tip))
    title = "Error against float32 per module: output error (bar), added here (inner bar), tolerance (tick)"
    return f"<h3>Error vs tolerance{escape(note)}</h3>" + bar_chart("numerics-error", bars, "log10", title)


def _dtype_max(e: dict[str, Any]) -> float | None:
    absmax, margin = number(e.get("absmax")), number(e.get("margin_pow2"))
    if e.get("dtype") in DTYPE_MAX:
        return DTYPE_MAX[str(e["dtype"])]
    if absmax is not None and margin is not None and math.isfinite(absmax) and math.isfinite(margin) and absmax > 0:
        top: float = absmax * math.pow(2.0, margin)
        return top
    return None


def _range_chart(entries: list[dict[str, Any]], first: str | None) -> str:
    rows = [e for e in entries if number(e.get("absmax")) is not None]
    if not rows:
        return ""

    def margin(e: dict[str, Any]) -> float:
        m = number(e.get("margin_pow2"))
        absmax = number(e.get("absmax")) or 0.0
        return -math.inf if not math.isfinite(absmax) else m if m is not None else math.inf

    rows, note = _pick(rows, margin)
    bars = []
    for e in rows:
        absmax = number(e.get("absmax")) or 0.0
        top, m = _dtype_max(e), number(e.get("margin_pow2"))
        if m is None and top is not None and absmax > 0 and math.isfinite(absmax):
            m = math.log2(top / absmax)
        close = m is not None and m < _TIGHT_MARGIN
        kind = (
            "bad"
            if not math.isfinite(absmax) or e["module"] == first or (m is not None and m < 0)
            else ("warn" if close else "ok")
        )
        text = fmt_number(absmax) + (f" · margin 2^{m:.1f}" if m is not None and math.isfinite(m) else "")
        dtype = f" ({e['dtype']})" if e.get("dtype") else ""
        tip = f"{e['module']}{dtype}: absmax {fmt_number(absmax)}" + (
            f", dtype max {fmt_number(top)}" if top is not None else ""
        )
        bars.append(Bar(e["module"], absmax, text, kind, marker=top, tip=tip))
    title = "Largest magnitude per module (bar) against the dtype's largest value (tick), log2 scale"
    return f"<h3>absmax vs dtype range{escape(note)}</h3>" + bar_chart("numerics-range", bars, "log2", title)


def _table(entries: list[dict[str, Any]]) -> str:
    keys: list[str] = []
    for e in entries:
        keys += [k for k in e if k != "module" and k not in keys]
    head = "<tr><th>module</th>" + "".join(f"<th>{escape(k)}</th>" for k in keys) + "</tr>"

    def cell(v: Any) -> str:
        n = number(v)
        return escape(fmt_number(n)) if n is not None else escape("" if v is None else str(v))

    body = "".join(
        f'<tr data-module="{escape(str(e["module"]))}"><td>{escape(str(e["module"]) or "(model)")}</td>'
        + "".join(f"<td>{cell(e.get(k))}</td>" for k in keys)
        + "</tr>"
        for e in entries
    )
    return (
        f'<details class="cw-table-wrap"><summary>All {len(entries)} modules</summary>'
        f'<table class="cw-table">{head}{body}</table></details>'
    )


def numerics_html(entries: list[dict[str, Any]], findings: list[dict[str, Any]]) -> str:
    entries = [e for e in entries if isinstance(e, dict) and "module" in e]
    if not entries:
        return ""
    first = first_nonfinite(entries)
    first_name = None if first is None else str(first["module"])
    parts = ['<section class="cw-section cw-numerics" id="numerics"><h2>Numerics</h2>']
    cw3 = [f for f in findings if str(f.get("code", "")).startswith("CW3")]
    if first is not None:
        # the op: the entry's own, else the numerics finding's at that module
        named = first.get("op") or next((f.get("op") for f in cw3 if f.get("module") == first_name), None)
        op = f" in {named}" if named else ""
        parts.append(
            f'<p class="cw-callout cw-nonfinite">First non-finite value made by '
            f"<code>{escape(first_name or '(model)')}</code>{escape(op)}.</p>"
        )
    if cw3:
        parts.append(
            f'<p class="cw-note">{len(cw3)} numerics finding(s): '
            + ", ".join(
                f"<code>{escape(str(f.get('code')))}</code> at <code>{escape(str(f.get('module')))}</code>" for f in cw3
            )
            + "</p>"
        )
    parts.append(_error_chart(entries, first_name))
    parts.append(_range_chart(entries, first_name))
    parts.append(_table(entries))
    parts.append("</section>")
    return "".join(parts)
