"""``castwise numerics TARGET (--locate | --forecast DT | --compare | --tune BUDGET)``.

Exit codes (DESIGN.md): 0 no error findings, 1 error findings, 2 usage or internal error, 3 the
run could not cover the whole model (it raised part way), 130 interrupted. The lead registers
:data:`numerics_command` in the main CLI; it imports torch only when it runs.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from castwise.cli import (
    EXIT_FINDINGS,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    DeviceChoice,
    user_stdout_aside,
    write_json,
)
from castwise.errors import CastwiseError


def _exit_code(report: Any) -> int:
    if not report.ok:
        return EXIT_FINDINGS
    runs = report.runs  # a Report's runs; tune's Tuned counts its runs instead (an int)
    if isinstance(runs, (list, tuple)) and any(r.status == "incomplete" for r in runs):
        return EXIT_INCOMPLETE
    return EXIT_OK


def _json(report: Any, built: str | None) -> str:
    """The report's JSON; how a config target was built under summary.numerics.built (a Tuned
    has no summary of its own, so it is added to its dict)."""
    data = report.to_dict()
    if built is not None:
        data.setdefault("summary", {}).setdefault("numerics", {})["built"] = built
    return json.dumps(data, indent=2)


def _pick(locate: bool, forecast: str | None, compare: bool, tune: str | None) -> str:
    chosen = [
        name
        for name, on in (
            ("--locate", locate),
            ("--forecast", forecast is not None),
            ("--compare", compare),
            ("--tune", tune is not None),
        )
        if on
    ]
    if len(chosen) != 1:
        said = ", ".join(chosen) if chosen else "none"
        raise click.UsageError(f"give exactly one of --compare, --forecast DT, --locate, --tune BUDGET (got {said})")
    return chosen[0]


def _load(target: str) -> tuple[Any, Any, str | None]:
    """(model, inputs, how it was built): a ``file.py:function`` / ``module:function`` target, or
    a transformers ``config.json`` (built with random weights, shrunk to fit: see shrink)."""
    if target.endswith(".json") and ":" not in target:
        from castwise.numerics.shrink import from_config

        return from_config(target)
    from castwise.cli.target import load_target

    model, inputs = load_target(target)
    return model, inputs, None


def _run(
    target: str,
    which: str,
    forecast_dt: str | None,
    tune_budget: str | None,
    policy: str | None,
    mode: str,
    device: str | None,
    layerwise: bool = False,
) -> tuple[Any, str | None]:
    model, inputs, built = _load(target)
    report: Any
    if which == "--locate":
        from castwise.numerics.locate import locate_nonfinite

        report = locate_nonfinite(model, inputs, policy=policy, mode=mode, device=device)
    elif which == "--forecast":
        from castwise.numerics.forecast import forecast

        report = forecast(
            model,
            inputs,
            target=forecast_dt or "f16",
            policy=policy,
            mode=mode,
            device=device,
            layerwise=True if layerwise else None,
        )
    elif which == "--compare":
        from castwise.numerics.compare import compare  # type: ignore[import-not-found, unused-ignore]

        if policy is None:
            raise CastwiseError("--compare needs --policy P (the policy to compare against 32-true)")
        report = compare(model, inputs, policy=policy, mode=mode)
    else:
        from castwise.numerics.tune import tune  # type: ignore[import-not-found, unused-ignore]

        if policy is None:
            raise CastwiseError("--tune needs --policy P (the policy to add float32 islands to)")
        tuned = tune(model, inputs, policy=policy, budget=float(tune_budget or "0"), mode=mode)
        report = tuned
    if built is not None and isinstance(getattr(report, "summary", None), dict):
        report.summary.setdefault("numerics", {})["built"] = built  # the HTML page says it too
    return report, built


@click.command("numerics")
@click.argument("target")
@click.option("--locate", is_flag=True, help="The first op that made a NaN/Inf, and why (real tensors).")
@click.option(
    "--forecast",
    "forecast_dt",
    default=None,
    metavar="DT",
    help="Where DT (f16, bf16, float8_e4m3fn, float8_e5m2, or a precision: fp8, 16-mixed, ...) would "
    "overflow or flush to zero.",
)
@click.option("--compare", is_flag=True, help="Error of --policy against 32-true, per module.")
@click.option("--tune", "tune_budget", default=None, metavar="BUDGET", help="float32 islands meeting BUDGET.")
@click.option("--policy", "-p", default=None, help="Precision policy (any string Policy.parse accepts).")
@click.option("--mode", type=click.Choice(["train", "eval"]), default="train", show_default=True)
@click.option("--device", type=DeviceChoice(), default=None, help="Where to run (default: the model's).")
@click.option("--json", "json_path", default=None, metavar="PATH|-", help="Write the JSON report.")
@click.option("--html", "html_path", default=None, metavar="PATH", help="Write the report as one offline HTML page.")
@click.option(
    "--layerwise",
    is_flag=True,
    help="--forecast one repeated block at a time (models too large to run whole; see docs/numerics.md).",
)
def numerics_command(
    target: str,
    locate: bool,
    forecast_dt: str | None,
    compare: bool,
    tune_budget: str | None,
    policy: str | None,
    mode: str,
    device: str | None,
    json_path: str | None,
    html_path: str | None,
    layerwise: bool,
) -> None:
    """Values, not dtypes: run TARGET (file.py:function or module:function -> (model, inputs), or
    a transformers config.json) on real tensors."""
    which = _pick(locate, forecast_dt, compare, tune_budget)
    try:
        if html_path is not None:
            from castwise.report.html import check_html_path

            check_html_path(html_path)  # a wrong path fails before the model runs
        if layerwise and which != "--forecast":
            raise CastwiseError(f"--layerwise goes with --forecast DT, not {which}")
        with user_stdout_aside(json_path):
            report, built = _run(target, which, forecast_dt, tune_budget, policy, mode, device, layerwise)
        if json_path != "-":
            click.echo(str(report))
        write_json(_json(report, built), json_path)
        if html_path is not None:
            from castwise.report.html import write_html

            write_html(report, html_path)
        code = _exit_code(report)
    except CastwiseError as exc:
        click.echo(f"castwise: error: {exc}", err=True)
        code = EXIT_USAGE
    except (OSError, ValueError) as exc:
        click.echo(f"castwise: error: {type(exc).__name__}: {exc}", err=True)
        code = EXIT_USAGE
    except KeyboardInterrupt:
        click.echo("castwise: interrupted", err=True)
        code = EXIT_INTERRUPTED
    sys.exit(code)
