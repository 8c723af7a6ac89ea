"""`castwise run [OPTIONS] SCRIPT [ARGS...]`: a training script as it is, audited as it runs."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from castwise.cli import EXIT_FINDINGS, DeviceChoice, check_json_path, error, terminal_width
from castwise.errors import CastwiseError

if TYPE_CHECKING:
    from castwise.integrations.ranks import Meeting
    from castwise.integrations.run import Watcher
    from castwise.report import Report

Reporter = Callable[[str, "Report"], None]


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--policy", "-p", default=None, help="Audit in this policy instead of the precision the script runs in.")
@click.option("--device", type=DeviceChoice(), default=None, help="Target device to simulate (default: the model's).")
@click.option("--mode", type=click.Choice(["train", "eval", "both"]), default="both", show_default=True)
@click.option("--stop", is_flag=True, help="Stop the script at the first error finding.")
@click.option("--json", "json_path", default=None, metavar="PATH", help="Write the reports as JSON to PATH.")
@click.option("-m", "as_module", is_flag=True, help="SCRIPT is a module, run as `python -m SCRIPT` would.")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    policy: str | None,
    device: str | None,
    mode: str,
    stop: bool,
    json_path: str | None,
    as_module: bool,
    script: str,
    args: tuple[str, ...],
) -> int:
    """Run SCRIPT as `python SCRIPT ARGS` would and audit each model at its first forward.

    castwise's lines go to stderr; the script's stdout is left as it is. The exit code is the
    script's own, or 1 when it exited 0 and an audit found an error."""
    from castwise.integrations.run import RunStopped, run_script
    from castwise.report import render_report

    if json_path == "-":
        error("castwise run --json needs a file: the script's stdout is the script's own")
        return 2
    if json_path is not None:
        check_json_path(json_path)
    if policy is not None:
        from castwise.policy import Policy

        try:
            Policy.parse(policy)
        except CastwiseError as exc:
            error(str(exc))
            return 2

    def show(name: str, report: Report) -> None:
        when = " (its first optimizer steps)" if "ledger" in report.extra else " at its first forward"
        print(f"castwise run: {name}{when}", file=sys.stderr)
        print(render_report(report, terminal_width()), file=sys.stderr, flush=True)

    def note(text: str) -> None:
        print(f"castwise run: note: {text}", file=sys.stderr, flush=True)

    watched = _watcher(dict(policy=policy, device=device, mode=mode, stop=stop), show, note)
    if watched is None:  # torchrun without its agent store, rank > 0: rank 0 speaks alone
        return _unwatched(script, list(args), as_module)
    watcher, meeting = watched
    try:
        code = run_script(script, list(args), watcher, module=as_module)
    except RunStopped as exc:
        error(str(exc))
        code = EXIT_FINDINGS
    except CastwiseError:
        raise
    except Exception as exc:  # the script's own error: printed as python prints it, exit 1 as python's
        print_script_error(exc)
        code = 1
    finally:
        if meeting is not None:
            meeting.finish()
    if watcher.on_report is None:
        return code  # the script's own: a rank exiting 1 for a finding would make torchrun stop rank 0
    if json_path is not None:
        import json

        models = [{"model": n, **r.to_dict()} for n, r in watcher.reports]
        ledgers = {"ledgers": [ledger.to_dict() for ledger in watcher.ledgers]} if watcher.ledgers else {}
        notes = {"notes": watcher.notes} if watcher.notes else {}
        payload = json.dumps({"schema": 1, "models": models, **ledgers, **notes})
        with open(json_path, "w", encoding="utf-8") as fh:
            fh.write(payload + "\n")
    if code == 0 and any(r.errors for _, r in watcher.reports):
        return EXIT_FINDINGS
    return code


def _watcher(
    options: dict[str, Any], show: Reporter, note: Callable[[str], None]
) -> tuple[Watcher, Meeting | None] | None:
    """The watcher of this process. Under torchrun / accelerate launch each rank audits its program
    (once per distinct program) and rank 0 prints one report per model for all ranks, the others
    print nothing (castwise.integrations.ranks); None: a rank > 0 with no store to meet through."""
    from castwise.integrations.ranks import launched_rank, meeting_from_env
    from castwise.integrations.run import Watcher

    lead = launched_rank() == 0
    meeting = meeting_from_env(None)
    if meeting is None and not lead:
        return None
    watcher = Watcher(**options, on_report=show if lead else None, on_note=note if lead else None, meeting=meeting)
    if meeting is not None:

        def joined(name: str, report: Report) -> None:  # rank 0: one model's report for every rank
            watcher.reports.append((name, report))
            show(name, report)

        meeting.on_report = joined
        meeting.start()
    elif os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        note("launched without torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE): only rank 0's program is audited")
    return watcher, meeting


def _unwatched(script: str, args: list[str], as_module: bool) -> int:
    from castwise.integrations.run import run_script

    try:
        return run_script(script, args, None, module=as_module)
    except Exception as exc:  # the script's own error, as python prints it
        print_script_error(exc)
        return 1


def print_script_error(exc: BaseException) -> None:
    """``exc``'s traceback as ``python SCRIPT`` prints it: without the frames of the machinery that
    ran the script (this command, runpy, the watcher's call wrapper), which are not the user's."""
    from castwise.integrations import run as runner

    machinery = {__file__, runner.__file__}

    def trimmed(te: traceback.TracebackException) -> traceback.TracebackException:
        frames = [f for f in te.stack if f.filename not in machinery and not f.filename.startswith("<frozen runpy")]
        te.stack = traceback.StackSummary.from_list(frames)
        for chained in (te.__cause__, te.__context__):
            if chained is not None:
                trimmed(chained)
        return te

    print("".join(trimmed(traceback.TracebackException.from_exception(exc)).format()), end="", file=sys.stderr)
