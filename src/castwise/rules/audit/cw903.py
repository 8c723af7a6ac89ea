"""CW903 branch-on-value: control flow on a value fake tensors do not have; both sides audited."""

from __future__ import annotations

from typing import Any

from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Mode, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._text import where

META = Rule(
    code="CW903",
    name="branch-on-value",
    category=None,
    severity="info",
    summary="The model branches on a tensor's value; the fake run took one side and the audit re-ran the other.",
    detects="A truth value fake tensors do not have (`if torch.isinf(h).any():`, `if mask.all():` on "
    "activations): the fake run answers False, then the mode runs again answering True at every such site. "
    "Also a size or number with no values behind it (`x[mask]`, `nonzero`, `masked_select`, `unique`, "
    "`repeat_interleave`, `int(n.item())`): a mask is taken as all True, every element as nonzero or "
    "distinct (the largest result), a number as 1, and the run goes on.",
    why="The branch that only runs on some values (BART's fp16 overflow clamp) is where a dtype error "
    "hides; the report says which side ran and whether the other was checked.",
    example="if hidden.dtype == torch.float16 and torch.isinf(hidden).any(): hidden = hidden.clamp(...)",
    fix="Nothing to fix: this says how the audit covered the branch. Where the other side was not "
    "checked, audit with `--real` on inputs that take it.",
)


def _assumed(size: dict[str, Any]) -> str:
    return str(size.get("assumed", "every element taken as nonzero"))


def _describe(site: dict[str, Any]) -> str:
    seen = "/".join(str(v) for v in (False, True) if site["answers"][v])
    other = "both values checked" if site.get("other_checked") else "True NOT checked"
    where_ = f"{site['file'].rsplit('/', 1)[-1]}:{site['line']}, {where(site['module'])}"
    return f"`{site['source'] or '?'}` ({where_}): taken as {seen}; {other}"


def _sites(session: Session) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Mode]]:
    sites: dict[Any, dict[str, Any]] = {}
    sizes: dict[str, dict[str, Any]] = {}
    modes: list[Mode] = []
    for r in session.runs:
        branches, assumed = r.trace.branches, r.trace.sizes
        if branches or assumed:
            modes.append(r.mode)
        for key, site in branches.items():
            if key not in sites or not site.get("other_checked"):
                sites[key] = site  # a site is checked only where every mode checked it
        for size in assumed:
            sizes.setdefault(f"{size['op']} in {where(size['module'])}: {_assumed(size)}", size)
    return list(sites.values()), list(sizes.values()), modes


def _scan(session: Session) -> list[Finding]:
    found, sizes, modes = _sites(session)
    if not found and not sizes:
        return []
    parts: list[str] = []
    if found:
        unchecked = sum(1 for s in found if not s.get("other_checked"))
        cover = (
            "a second run took each as True: both values checked"
            if not unchecked
            else f"a second run could not reach {unchecked} of them with True"
        )
        listed = "; ".join(_describe(s) for s in found[:6]) + (f"; and {len(found) - 6} more" if len(found) > 6 else "")
        parts.append(
            f"{len(found)} truth value(s) of tensors fake tensors have no values for; the run took each as False, "
            f"and {cover}. {listed}."
        )
    if sizes:
        ops = "; ".join(f"{s['op']} in {where(s['module'])}: {_assumed(s)}" for s in sizes[:4]) + (
            f"; and {len(sizes) - 4} more" if len(sizes) > 4 else ""
        )
        parts.append(
            f"{len(sizes)} size(s) or number(s) had no values behind them and were assumed (the largest "
            f"result: every branch it feeds, e.g. each expert of a MoE loop, ran): {ops}."
        )
    details = [
        {
            "file": s["file"],
            "line": s["line"],
            "source": s["source"],
            "module": s["module"],
            "taken": [v for v in (False, True) if s["answers"][v]],
            "other_checked": bool(s.get("other_checked")),
        }
        for s in found
    ]
    module = found[0]["module"] if found else sizes[0]["module"]
    return [
        Finding(
            code="CW903",
            module=module,
            op=None,
            modes=tuple(modes),
            message=" ".join(parts),
            details=(
                ("branches", details),
                (
                    "assumed_sizes",
                    [
                        {"module": s["module"], "op": s["op"], "shape": list(s["shape"]), "assumed": _assumed(s)}
                        for s in sizes
                    ],
                ),
            ),
        )
    ]


RULE = AuditRule(META, scan=_scan)
