"""The HTML report's findings and module tree, from a report's JSON form (``Report.to_dict()``).

The tree is static HTML (nested ``<details>``): it reads and folds without script, so a notebook
that does not run the report's script still shows it. The script adds search and "select a
finding": it opens the tree along the path from the finding's origin to where it shows.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

_OPEN_DEPTH = 3  # tree levels open by default: a 7B Llama shows its 32 layers, each folded


def dtype_class(tensor: str) -> str:
    """``"bf16[2, 4]"`` -> ``"cw-k-bf16"``: the colour of a dtype."""
    return "cw-k-" + escape(tensor.split("[", 1)[0].strip() or "other")


def _chip(text: str, title: str = "") -> str:
    tip = f' title="{escape(title)}"' if title else ""
    return f'<span class="cw-dt {dtype_class(text)}"{tip}>{escape(text)}</span>'


def parent_of(name: str, names: set[str]) -> str:
    """The nearest registered ancestor ("" is the root)."""
    parts = name.split(".")
    while len(parts) > 1:
        parts.pop()
        candidate = ".".join(parts)
        if candidate in names:
            return candidate
    return ""


def ancestors(name: str, names: set[str]) -> list[str]:
    """From ``name`` up to the root, both included."""
    out = [name]
    while out[-1] != "":
        out.append(parent_of(out[-1], names))
    return out


def finding_path(finding: dict[str, Any], names: set[str]) -> list[str]:
    """Modules from where the offending dtype came from up to the nearest common ancestor and
    down to where it shows; from the root when it came from a model input."""
    at = finding.get("module")
    if at is None or at not in names:
        return []
    origin = (finding.get("origin") or {}).get("module")
    down = ancestors(at, names)
    if origin is None or origin not in names:
        return list(reversed(down))
    up = ancestors(origin, names)
    common = next(a for a in up if a in set(down))
    return up[: up.index(common) + 1] + list(reversed(down[: down.index(common)]))


def display_name(name: str) -> str:
    return name if name else "(model)"


# -- findings -------------------------------------------------------------------------------------


def findings_html(findings: list[dict[str, Any]], names: set[str]) -> str:
    if not findings:
        return '<p class="cw-none">No findings.</p>'
    items = [_finding_html(i, f, names) for i, f in enumerate(findings)]
    return '<ol class="cw-findings">' + "".join(items) + "</ol>"


def _origin_text(origin: dict[str, Any] | None) -> str:
    if not origin:
        return ""
    module = origin.get("module")
    where = f"`{module}`" if module else "(model input)" if module == "" else ""
    parts = [where, origin.get("tensor") or "", f"op {origin['op']}" if origin.get("op") else ""]
    return " ".join(p for p in parts if p) or "(unknown)"


def _finding_html(index: int, f: dict[str, Any], names: set[str]) -> str:
    sev = str(f.get("severity") or "info")
    path = finding_path(f, names)
    origin = (f.get("origin") or {}).get("module")
    modes = f" [{', '.join(f['modes'])}]" if f.get("modes") else ""
    rows: list[tuple[str, str]] = []
    if f.get("module") is not None:
        rows.append(("at", f"`{display_name(f['module'])}`" + (f" in {f['op']}" if f.get("op") else "")))
    if f.get("origin"):
        rows.append(("origin", _origin_text(f["origin"])))
    if f.get("settings"):
        rows.append(("settings", ", ".join(f["settings"])))
    rows += [("in", loc) for loc in f.get("locations", [])]
    rows += [("why", str(f.get("message", ""))), ("fix", str(f.get("fix") or ""))]
    body = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows if v)
    attrs = (
        f'data-index="{index}" data-code="{escape(str(f.get("code")))}" '
        f'data-module="{escape(str(f.get("module") or ""))}" '
        f'data-origin="{escape("" if origin is None else origin)}" '
        f'data-path="{escape(json.dumps(path))}"'
    )
    head = (
        f'<div class="cw-fhead"><span class="cw-sev">{escape(sev)}</span> <code>{escape(str(f.get("code")))}'
        f'</code> <span class="cw-rule">{escape(str(f.get("name", "")))}</span>{escape(modes)}</div>'
    )
    trail = ""
    if path:
        chips = " → ".join(
            f'<span class="cw-step{" cw-step-origin" if n == origin else ""}'
            f'{" cw-step-at" if n == f.get("module") else ""}">{escape(display_name(n))}</span>'
            for n in path
        )
        trail = f'<div class="cw-trail"><span class="cw-trail-label">path</span> {chips}</div>'
    tab = ' tabindex="0" role="button" title="Show in the module tree"' if path else ""
    return f'<li class="cw-finding cw-sev-{escape(sev)}" {attrs}{tab}>{head}<dl>{body}</dl>{trail}</li>'


# -- module tree ----------------------------------------------------------------------------------


def tree_html(modules: list[dict[str, Any]], findings: list[dict[str, Any]]) -> str:
    names = {m["name"] for m in modules}
    by_name = {m["name"]: m for m in modules}
    children: dict[str, list[str]] = {}
    for m in modules:
        if m["name"] != "":
            children.setdefault(parent_of(m["name"], names), []).append(m["name"])
    pins: dict[str, list[str]] = {}
    opened: set[str] = set()
    for i, f in enumerate(findings):
        path = finding_path(f, names)
        if not path:
            continue
        code = escape(str(f.get("code")))
        pins.setdefault(f["module"], []).append(f'<button class="cw-pin" data-finding="{i}">{code}</button>')
        origin = (f.get("origin") or {}).get("module")
        if origin is not None and origin in names:
            pins.setdefault(origin, []).append(
                f'<button class="cw-pin cw-pin-origin" data-finding="{i}">origin of {code}</button>'
            )
        opened.update(a for n in path for a in ancestors(n, names)[1:])
    out: list[str] = []
    roots = [""] if "" in by_name else children.get("", [])
    stack: list[tuple[str, int, bool]] = [(n, 0, False) for n in reversed(roots)]
    while stack:  # iterative: deep models do not hit Python's recursion limit
        name, depth, closing = stack.pop()
        if closing:
            out.append("</details>")
            continue
        kids = children.get(name, [])
        out.append(
            _node_open(by_name[name], depth, bool(kids), depth < _OPEN_DEPTH or name in opened, pins.get(name, []))
        )
        if kids:
            stack.append((name, depth, True))
            stack.extend((k, depth + 1, False) for k in reversed(kids))
    return '<div class="cw-tree" role="tree">' + "".join(out) + "</div>"


def count(n: float) -> str:
    """An element count in a chip or chart: ``1.2M``, ``512``."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _node_open(m: dict[str, Any], depth: int, has_kids: bool, is_open: bool, pins: list[str]) -> str:
    name = m["name"]
    flags: list[str] = []
    if m.get("autocast"):
        flags.append(f'<span class="cw-flag cw-flag-autocast">autocast {escape(m["autocast"])}</span>')
    if m.get("upcast"):
        flags.append(
            '<span class="cw-flag cw-flag-upcast" title="low-precision inputs, float32 output, outside '
            'autocast">silent up-cast</span>'
        )
    elif m.get("cast"):
        flags.append('<span class="cw-flag cw-flag-cast" title="returns a dtype none of its inputs had">cast</span>')
    if m.get("raised"):
        flags.append('<span class="cw-flag cw-flag-raised">raised here</span>')
    if m.get("calls", 0) > 1:
        flags.append(f'<span class="cw-flag">{m["calls"]} calls</span>')
    params = " ".join(
        _chip(f"{k} {count(v)}", "own parameters: elements by dtype") for k, v in sorted(m.get("params", {}).items())
    )
    ins = " ".join(_chip(t) for t in m.get("inputs", []))
    outs = " ".join(_chip(t) for t in m.get("outputs", []))
    io = f'<span class="cw-io">{ins or "·"} → {outs or "·"}</span>' if ins or outs else ""
    cls = (
        "cw-row"
        + "".join(f" cw-{k}" for k in ("upcast", "cast", "raised") if m.get(k))
        + (" cw-has-pin" if pins else "")
    )
    short = name.rsplit(".", 1)[-1] if name else "(model)"
    row = (
        f'<span class="cw-name" title="{escape(display_name(name))}">{escape(short)}</span> '
        f'<span class="cw-type">{escape(str(m.get("type", "")))}</span>'
        f"{' <span class=cw-params>' + params + '</span>' if params else ''} {io} {''.join(flags)} {''.join(pins)}"
    )
    attrs = f'data-node="{escape(name)}" data-type="{escape(str(m.get("type", "")))}" data-depth="{depth}"'
    if has_kids:
        return f'<details class="cw-node" {attrs}{" open" if is_open else ""}><summary class="{cls}">{row}</summary>'
    return f'<div class="cw-node cw-leaf" {attrs}><div class="{cls}">{row}</div></div>'
