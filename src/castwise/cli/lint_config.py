"""`castwise lint-config FILES`: contradictory precision settings, from the files alone (no torch)."""

from __future__ import annotations

import click

from castwise.cli import EXIT_FINDINGS, EXIT_OK, check_json_path, emit, guard, json_option, terminal_width


@click.command("lint-config")
@click.argument("files", nargs=-1, required=True)
@json_option()
def lint_config(files: tuple[str, ...], json_path: str | None) -> int:
    """Check the precision settings of training configuration FILES for contradictions."""

    def body() -> int:
        from castwise.lint import lint_config as run_lint
        from castwise.lint import render

        check_json_path(json_path)
        report = run_lint(list(files) if len(files) > 1 else files[0])
        emit(render(report, terminal_width()), report.to_json(), json_path)
        return EXIT_OK if report.ok else EXIT_FINDINGS

    return guard(body)
