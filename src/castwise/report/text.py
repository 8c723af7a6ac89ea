"""Human-readable reports: plain text at a given width (100 by default, the CLI passes the
terminal's); 80 columns read well."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from castwise._wrap import wrap

if TYPE_CHECKING:
    from castwise.report import Finding, Report

WIDTH = 100
_LABEL = 9  # width of the "at", "origin", "fix" labels column


def _field(label: str, text: str, width: int) -> list[str]:
    # a policy, a module path or a code span is never split across lines (castwise._wrap)
    return wrap(" ".join(text.split()), width, f"  {label:<{_LABEL}}", " " * (2 + _LABEL))


def render_finding(f: Finding, width: int = WIDTH) -> list[str]:
    head = f"{f.level} {f.code} {f.rule.name}"
    if f.modes:
        head += f"  [{', '.join(f.modes)}]"
    lines = [head]
    if f.module is not None:
        at = f"`{f.module}`" if f.module else "(model)"
        lines += _field("at", at + (f" in {f.op}" if f.op else ""), width)
    if f.origin is not None:
        origin = str(f.origin) + (f" ({f.source})" if f.source else "")
        lines += _field("origin", origin, width)
    if f.settings:
        lines += _field("settings", ", ".join(f.settings), width)
    for loc in f.locations:
        lines += _field("in", loc, width)
    lines += _field("why", f.message, width)
    lines += _field("fix", f.fix or f.rule.fix, width)
    if f.code_fix is not None:
        checked = "  (verified by a re-audit)" if f.code_fix.verified else ""
        lines += _field("change", f"{f.code_fix.file}:{f.code_fix.line}  {f.code_fix.replace.strip()}{checked}", width)
    return lines


def render_report(report: Report, width: int = WIDTH) -> str:
    counts = {level: sum(f.level == level for f in report.findings) for level in ("error", "warning", "info")}
    tally = ", ".join(f"{n} {level}{'s' if n != 1 else ''}" for level, n in counts.items() if n) or "no findings"
    lines = wrap(f"{report.title}:", width, subsequent_indent="  ")
    if len(lines[-1]) + 1 + len(tally) <= width:  # the tally stays in one piece
        lines[-1] += f" {tally}"
    else:
        lines.append(f"  {tally}")
    if report.runs:
        runs = ", ".join(
            f"{r.mode}{' compiled' if r.kind == 'compiled' else ''} on {r.device}: {r.status}" for r in report.runs
        )
        lines += wrap(f"runs: {runs}", width, subsequent_indent="      ")
    for f in report.sorted_findings():
        lines.append("")
        lines += render_finding(f, width)
    if report.suggested_policy is not None:
        lines.append("")
        lines += wrap(
            f"suggested policy: {report.suggested_policy}  (a re-audit under it finds no error; "
            + (
                "shard with castwise.fsdp2.fully_shard(model, ...))"
                if report.extra.get("units")
                else "apply it with castwise.apply(model, castwise.Policy.parse(...)))"
            ),
            width,
            subsequent_indent="  ",
        )
    units = report.extra.get("units")
    if units:  # a distributed audit: what each FSDP2 unit gathers, computes and reduces in
        lines += ["", "units (stored / gather / compute / reduce / output):"]
        lines += [
            f"  {u['unit']}: {u['stored'] or '-'} / {u['gather']} / {u['compute']} / {u['reduce']} / "
            f"{u['output'] or '-'}  ({u['kind']})"
            for u in units
        ]
    act = report.summary.get("activation_bytes_by_dtype")
    if act:
        total = sum(act.values()) or 1
        share = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(act.items(), key=lambda kv: -kv[1]))
        lines.append("")
        lines += wrap(f"activations by dtype: {share}", width, subsequent_indent="  ")
    lines += _compiled_lines(report.summary.get("compiled") or {}, width)
    return "\n".join(lines)


def _compiled_lines(compiled: dict[str, Any], width: int) -> list[str]:
    """What torch.compile did in each compiled run: graphs, graph breaks, its own error."""
    lines: list[str] = []
    for mode, c in compiled.items():
        breaks = c.get("graph_breaks") or []
        head = (
            f"compiled ({mode}): {c.get('graphs', 0)} graph(s), {c.get('backward_graphs', 0)} backward, "
            f"{c.get('ops_checked', 0)} aten ops checked"
            + (" after Inductor's decompositions" if c.get("decompositions") == "inductor" else "")
            + f", {sum(b['count'] for b in breaks)} graph break(s)"
            + (" under fullgraph=True" if c.get("fullgraph") else "")
        )
        lines += ["", *wrap(head, width, subsequent_indent="  ")]
        for b in breaks:
            at = f" at {b['source']}" if b.get("source") else ""
            lines += wrap(f"- break{at}: {b['reason']}", width, subsequent_indent="  ")
        if c.get("backward_untraced"):
            lines += wrap(f"- backward graphs not traced {c['backward_untraced']}", width, subsequent_indent="  ")
        if c.get("error"):
            lines += wrap(f"- torch.compile stopped: {c['error']}", width, subsequent_indent="  ")
    return lines
