"""Reports as one self-contained HTML file: inline CSS, script and SVG, no network, opens offline.

``render_html(report)`` makes the page from the report's JSON form (``Report.to_dict()``, whose
``summary["modules"]`` is the audit's module tree and ``"numerics"`` the per-module numbers of a
numerics run): findings with the path from origin to where they show, the module tree
(collapsible, searchable) with parameter and activation dtypes, casts and silent up-casts,
parameters and activation bytes by dtype, the numerics charts, and the precision ledger
(``"ledger"``, a table). ``render_fragment`` is the same report as one ``<div>`` for a notebook
cell (``Report._repr_html_``). Torch-free.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from html import escape
from typing import Any

from castwise._dtypes import short
from castwise.errors import HtmlWriteError
from castwise.report._html_assets import CSS, JS
from castwise.report._html_numerics import numerics_html
from castwise.report._html_tree import count, findings_html, tree_html
from castwise.report._svg import Bar, bar_chart, fmt_bytes

_IDS = itertools.count(1)


def _data(report: Any) -> tuple[dict[str, Any], str]:
    """The report's JSON form and its title, from a Report (anything with ``to_dict``) or a dict."""
    if isinstance(report, Mapping):
        data = dict(report)
        return data, str(data.get("title") or "castwise report")
    to_dict = getattr(report, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(f"render_html needs a castwise Report or its to_dict() form, got {type(report).__name__}")
    data = to_dict()
    return data, str(getattr(report, "title", None) or data.get("title") or "castwise report")


def _header(data: dict[str, Any], title: str) -> str:
    findings = data.get("findings") or []
    counts = {lv: sum(f.get("severity") == lv for f in findings) for lv in ("error", "warning", "info")}
    tally = (
        "".join(f'<span class="cw-t-{lv}">{n} {lv}{"s" if n != 1 else ""}</span>' for lv, n in counts.items() if n)
        or '<span class="cw-t-none">no findings</span>'
    )
    parts = [f"<h1>{escape(title)}</h1>", f'<div class="cw-tally">{tally}</div>']
    runs = data.get("runs")
    if isinstance(runs, list) and runs:  # tune's dict counts its runs (an int): nothing to list
        text = ", ".join(
            f"{r.get('mode')}{' compiled' if r.get('kind') == 'compiled' else ''} on {r.get('device')}: "
            f"{r.get('status')}"
            for r in runs
        )
        parts.append(f'<div class="cw-meta">runs: {escape(text)}</div>')
    if data.get("suggested_policy"):
        parts.append(
            f'<div class="cw-policy">suggested policy: <code>{escape(str(data["suggested_policy"]))}</code>'
            " (a re-audit under it finds no error; apply it with "
            "<code>castwise.apply(model, castwise.Policy.parse(...))</code>)</div>"
        )
    return "".join(parts)


def _by_dtype_chart(name: str, counts: Mapping[str, Any], title: str, as_bytes: bool) -> str:
    items = [(k, float(v)) for k, v in counts.items() if isinstance(v, (int, float))]
    total = sum(v for _k, v in items) or 1.0
    bars = []
    for k, v in sorted(items, key=lambda kv: -kv[1]):
        label = short(k)
        amount = fmt_bytes(v) if as_bytes else f"{count(v)} elements"
        bars.append(Bar(label, v, f"{amount} ({100 * v / total:.0f}%)", label))
    tick = fmt_bytes if as_bytes else count
    return bar_chart(name, bars, "linear", title, tick) if bars else ""


def _overview(summary: dict[str, Any]) -> str:
    charts = []
    params = summary.get("params_by_dtype") or {}
    if params:
        charts.append(
            "<h3>Parameters by dtype</h3>"
            + _by_dtype_chart("params-by-dtype", params, "Parameter elements by dtype", as_bytes=False)
        )
    act = summary.get("activation_bytes_by_dtype") or {}
    if act:
        charts.append(
            "<h3>Activation bytes by dtype</h3>"
            + _by_dtype_chart(
                "activation-bytes", act, "Bytes of floating activations made in forward, by dtype", as_bytes=True
            )
        )
    if not charts:
        return ""
    return '<section class="cw-section" id="dtypes"><h2>Dtypes</h2>' + "".join(charts) + "</section>"


def _tree_section(modules: list[dict[str, Any]], findings: list[dict[str, Any]]) -> str:
    if not modules:
        return ""
    flagged = sum(bool(m.get("upcast")) for m in modules)
    casts = sum(bool(m.get("cast")) for m in modules)
    return (
        '<section class="cw-section" id="modules"><h2>Modules</h2>'
        f'<p class="cw-legend">{len(modules)} modules · {casts} cast at their boundary · {flagged} silent '
        "up-cast(s). Each row: own parameters by dtype, input → output activations (first call), autocast in "
        "force. Select a finding to see the path from its origin to where it shows.</p>"
        '<div class="cw-toolbar"><input class="cw-search" type="search" placeholder="Search modules by name or '
        'type" aria-label="Search modules"><span class="cw-count"></span><button class="cw-expand" type="button">'
        'expand all</button><button class="cw-collapse" type="button">collapse all</button></div>'
        '<div class="cw-pathbar" aria-live="polite"></div>' + tree_html(modules, findings) + "</section>"
    )


def _ledger_section(ledger: Any) -> str:
    """The precision ledger (``to_dict()["ledger"]``) as a table: one row per parameter group,
    each cell's value with where it comes from as its tooltip."""
    rows = ledger.get("rows") if isinstance(ledger, Mapping) else None
    if not rows:
        return ""
    fields = [k for k in rows[0] if k != "params"]
    head = "".join(f"<th>{escape(k.replace('_', ' '))}</th>" for k in ["params", *fields])
    body = []
    for r in rows:
        params = list(r.get("params") or [])
        shown = ", ".join(params[:4]) + (f" (+{len(params) - 4} more)" if len(params) > 4 else "")
        cells = [f'<td title="{escape(", ".join(params))}">{escape(shown)}</td>']
        for k in fields:
            e = r.get(k) or {}
            why = "; ".join(x for x in (e.get("source"), e.get("note")) if x)
            cells.append(f'<td title="{escape(why)}">{escape(short(str(e.get("value", "unknown"))))}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        '<section class="cw-section" id="ledger"><h2>Precision ledger</h2>'
        f'<p class="cw-legend">{escape(str(ledger.get("source", "")))}: per parameter group, where a training '
        "step keeps each precision (hover a cell for where it comes from).</p>"
        f'<table class="cw-table cw-ledger"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
        "</section>"
    )


def render_fragment(report: Any) -> str:
    """The report as one ``<div class="cw-report">`` with its own style and script."""
    data, title = _data(report)
    findings = list(data.get("findings") or [])
    summary = dict(data.get("summary") or {})
    modules = [m for m in summary.get("modules") or [] if isinstance(m, dict) and "name" in m]
    names = {m["name"] for m in modules}
    numerics = numerics_html(list(data.get("numerics") or []), findings)
    ledger = _ledger_section(data.get("ledger"))
    root = f"cw-report-{os.getpid()}-{next(_IDS)}"
    nav = [
        ("findings", "Findings"),
        ("modules", "Modules") if modules else None,
        ("dtypes", "Dtypes") if summary.get("activation_bytes_by_dtype") or summary.get("params_by_dtype") else None,
        ("numerics", "Numerics") if numerics else None,
        ("ledger", "Ledger") if ledger else None,
    ]
    links = "".join(f'<a href="#{a}">{t}</a>' for item in nav if item for a, t in [item])
    return (
        f'<div class="cw-report" id="{root}"><style>{CSS}</style>'
        + _header(data, title)
        + f"<nav>{links}</nav>"
        + '<section class="cw-section" id="findings"><h2>Findings</h2>'
        + findings_html(findings, names)
        + "</section>"
        + _tree_section(modules, findings)
        + _overview(summary)
        + numerics
        + ledger
        + f"<script>{JS.replace('__ROOT__', root)}</script></div>"
    )


def render_html(report: Any) -> str:
    """A complete HTML document for ``report`` (a Report, or its ``to_dict()`` form)."""
    _unused, title = _data(report)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # no request may leave the file: not even the browser's automatic favicon fetch
        '<link rel="icon" href="data:,">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{escape(title)}</title></head><body>{render_fragment(report)}</body></html>\n"
    )


def check_html_path(path: str | os.PathLike[str]) -> None:
    """Refuse a path the report cannot be written to (before any work, with a clear error)."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target)) or "."
    if os.path.isdir(target):
        example = os.path.join(target, "report.html")
        raise HtmlWriteError(f"--html {target}: is a folder; give a file name, e.g. {example}")
    if not os.path.isdir(folder):
        raise HtmlWriteError(f"--html {target}: the folder {folder} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise HtmlWriteError(f"--html {target}: not writable; choose a path you can write to")


def write_html(report: Any, path: str | os.PathLike[str]) -> str:
    """Write ``render_html(report)`` to ``path``; returns the path. The folder is checked first, so a
    wrong path fails before any rendering, with a clear error."""
    target = os.fspath(path)
    check_html_path(target)
    text = render_html(report)
    try:
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise HtmlWriteError(f"--html {target}: could not write ({exc.strerror or exc}); choose another path") from exc
    return target


__all__ = ["HtmlWriteError", "check_html_path", "render_fragment", "render_html", "write_html"]
