"""`castwise rules [CODE]`: the diagnostic catalog, or one rule's page (no torch)."""

from __future__ import annotations

import click

from castwise._wrap import wrap
from castwise.cli import EXIT_OK, guard, terminal_width


def listing(width: int) -> str:
    """One line per rule (code, name, severity, summary) when that fits the width; otherwise
    the summary goes under its rule, indented, so every rule's first line starts with its code."""
    from castwise import rules as catalog

    every = catalog.all_rules()
    name_w = max(len(r.name) for r in every)
    one_line = [f"{r.code}  {r.name:<{name_w}}  {r.severity:<7}  {r.summary}" for r in every]
    if max(map(len, one_line)) <= width:
        return "\n".join(one_line)
    lines: list[str] = []
    for r in every:
        lines.append(f"{r.code}  {r.name}  ({r.severity})")
        lines += wrap(r.summary, width, " " * 7, " " * 7)
    return "\n".join(lines)


@click.command()
@click.argument("code", required=False)
def rules(code: str | None) -> int:
    """List the diagnostic catalog, or print the page of one rule (CODE or kebab-case name)."""

    def body() -> int:
        from castwise import rules as catalog

        width = terminal_width()
        click.echo(catalog.get(code).page(width) if code else listing(width))
        return EXIT_OK

    return guard(body)
