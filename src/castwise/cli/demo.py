"""`castwise demo`: the five stories on built-in models (castwise.demo), diagnosed and fixed."""

from __future__ import annotations

import click

from castwise.cli import guard, terminal_width


@click.command()
def demo() -> int:
    """Run the five stories on built-in models: the real error, the diagnosis, the fix."""

    def body() -> int:
        from castwise.demo import run_demo

        return run_demo(width=terminal_width())

    return guard(body)
