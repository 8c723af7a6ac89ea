"""`castwise audit TARGET`: the dtype flow of a model, on fake tensors by default."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from castwise.cli import (
    EXIT_FINDINGS,
    EXIT_INCOMPLETE,
    EXIT_OK,
    DeviceChoice,
    check_json_path,
    emit,
    guard,
    json_option,
    terminal_width,
    user_stdout_aside,
)
from castwise.errors import TargetError

if TYPE_CHECKING:
    from castwise.report import Report


def exit_code(report: Report) -> int:
    """1 for error findings; else 3 when a run could not check the whole model (never 0); else 0."""
    if report.errors:
        return EXIT_FINDINGS
    if report.incomplete:
        return EXIT_INCOMPLETE
    return EXIT_OK


@click.command()
@click.argument("target")
@click.option("--policy", "-p", default=None, help="Precision policy (any string Policy.parse accepts).")
@click.option(
    "--device",
    type=DeviceChoice(),
    default=None,
    help="Target device to simulate: cpu (this machine), a CPU class (cpu:avx2), cuda or a GPU (cuda:t4). "
    "Default: where the model is.",
)
@click.option("--mode", type=click.Choice(["train", "eval", "both"]), default="both", show_default=True)
@click.option("--real", is_flag=True, help="Run on real tensors on this machine instead of fake tensors.")
@click.option(
    "--seq-len",
    type=int,
    default=None,
    metavar="N",
    help="Config targets: token ids of this length, batch 1 (default 128).",
)
@click.option(
    "--torch",
    "torch_release",
    default=None,
    metavar="X.Y[,X.Y]",
    help="Autocast as that torch release "
    "(recorded lists, not installed); two: every module whose dtype flow changes between them.",
)
@click.option(
    "--optimizer",
    default=None,
    metavar="CLASS",
    help="Step this optimizer class (torch.optim.AdamW) after the train run's backward: the precision "
    "ledger and its findings in the report.",
)
@click.option("--lr", default=None, type=float, help="--optimizer's learning rate (default: the class's).")
@click.option("--optimizer-kwargs", default=None, metavar="JSON", help="More --optimizer settings, a JSON object.")
@json_option()
@click.option("--html", "html_path", default=None, metavar="PATH", help="Write the report as one offline HTML page.")
def audit(
    target: str,
    policy: str | None,
    device: str | None,
    mode: str,
    real: bool,
    seq_len: int | None,
    torch_release: str | None,
    optimizer: str | None,
    lr: float | None,
    optimizer_kwargs: str | None,
    json_path: str | None,
    html_path: str | None,
) -> int:
    """Audit the dtype flow of TARGET: file.py:function or module:function returning (model,
    inputs), or a transformers config.json (also hf:PATH_OR_DIR), built on the meta device."""

    def body() -> int:
        from castwise.auditor import audit as run_audit
        from castwise.cli.target import is_config_target, load_target, working_dir_on_path
        from castwise.policy import Policy

        check_json_path(json_path)
        if html_path is not None:
            from castwise.report.html import check_html_path

            check_html_path(html_path)
        if real and is_config_target(target):
            raise TargetError(
                f"target {target!r}: a model built from a config has no weights, so --real cannot run "
                "it; drop --real (fake tensors need none) or audit a builder function"
            )
        if policy is not None:
            Policy.parse(policy)  # a bad policy fails before the model loads, not after
        from castwise.cli.torch_diff import diff_main, releases_of

        pair = releases_of(torch_release) if torch_release is not None else ()
        from castwise.cli.ledger import optimizer_options

        step = optimizer_options(optimizer, lr, optimizer_kwargs)
        # the model's own lazy imports find the project too
        with working_dir_on_path(), user_stdout_aside(json_path):
            model, inputs = load_target(target, seq_len=seq_len)
            from castwise._progress import progress

            if len(pair) == 2:
                return diff_main(model, inputs, pair, policy, device, not real, json_path)
            with progress(f"auditing {target} on {'real' if real else 'fake'} tensors"):
                report = run_audit(
                    model,
                    inputs,
                    policy=policy,
                    device=device,
                    mode=mode,
                    fake=not real,
                    torch=torch_release,
                    **step,
                )
            if real and policy is not None:  # the silent findings' fixes, run against float32 here
                from castwise.numerics.silent import verify_fixes

                with progress("verifying the silent findings' fixes on real tensors"):
                    once = "train" if mode == "both" else mode
                    report = verify_fixes(model, inputs, report, policy=policy, mode=once, device=device)
        from castwise.report import render_report

        if html_path is not None:
            from castwise.report.html import write_html

            write_html(report, html_path)

        emit(render_report(report, terminal_width()), report.to_json(), json_path)
        return exit_code(report)

    return guard(body)
