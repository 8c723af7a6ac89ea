"""The `castwise` command line: the click group, ``main`` and what every subcommand shares.

Each subcommand lives in its own module and is imported on first use (``COMMANDS``), so
`castwise explain`, `lint-config` and `rules` never import torch. Exit codes: 0 no error
findings, 1 error findings, 2 usage or internal error, 3 the audit could not check the whole
model, 130 interrupted.

Registering a subcommand that lives elsewhere is one entry in ``COMMANDS``:
``"numerics": ("castwise.cli.numerics", "numerics_command")``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from castwise.errors import CastwiseError

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INCOMPLETE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# name -> (module, attribute of a click command there); imported only when that command runs
# (or when --help lists them all)
COMMANDS: dict[str, tuple[str, str]] = {
    "audit": ("castwise.cli.audit", "audit"),
    "demo": ("castwise.cli.demo", "demo"),
    "explain": ("castwise.cli.explain", "explain"),
    "ledger": ("castwise.cli.ledger", "ledger"),
    "lint-config": ("castwise.cli.lint_config", "lint_config"),
    "numerics": ("castwise.cli.numerics", "numerics_command"),
    "rules": ("castwise.cli.rules", "rules"),
    "run": ("castwise.cli.run", "run"),
}

# Output width: the terminal's (COLUMNS first, as shutil does), 100 when the output is not a
# terminal (pipes and files keep one stable layout), clamped so that neither a tiny nor a huge
# window makes the text unreadable.
PIPE_WIDTH, MIN_WIDTH, MAX_WIDTH = 100, 60, 120
_MAX_MESSAGE = 2000  # an error message longer than this is cut in the middle
_LONG_TOKEN = re.compile(r"\S{201,}")  # an echoed argument (a policy, a path) that long is cut


def terminal_width() -> int:
    """The width to render human output at: the terminal's, clamped to [60, 120]; 100 in a pipe."""
    columns = shutil.get_terminal_size((PIPE_WIDTH, 24)).columns
    return max(MIN_WIDTH, min(MAX_WIDTH, columns))


def _cut(token: str) -> str:
    """``'xxxx...xx' (100,000 characters);``: quotes and trailing punctuation kept, the length told."""
    core = token.rstrip(";,.:)")
    punct = token[len(core) :]
    quote = core[0] if core[0] in "'\"" and core[-1] == core[0] else ""
    inner = core[1:-1] if quote else core
    return f"{quote}{inner[:60]}...{inner[-20:]}{quote} ({len(inner):,} characters){punct}"


def shorten(message: str) -> str:
    """An error message fit for a terminal: echoed arguments over 200 characters are cut, and
    so is a message over 2,000 characters (its end, with the valid options and the fix, is kept)."""
    message = _LONG_TOKEN.sub(lambda m: _cut(m.group(0)), message)
    if len(message) > _MAX_MESSAGE:
        message = f"{message[:1200]} ... {message[-600:]}"
    return message


def error(message: str) -> None:
    """Print one error line on stderr, as every command reports a failure."""
    click.echo(f"castwise: error: {shorten(message)}", err=True)


def interrupted() -> int:
    click.echo("castwise: interrupted", err=True)
    return EXIT_INTERRUPTED


def guard(body: Callable[[], int]) -> int:
    """Run a command body: castwise's own errors exit 2 with their message, not a traceback;
    Ctrl-C exits 130 with one line."""
    try:
        return body()
    except KeyboardInterrupt:
        return interrupted()
    except (CastwiseError, OSError, UnicodeDecodeError) as exc:
        error(str(exc))
        return EXIT_USAGE
    except SystemExit as exc:  # our bodies return their code: this came from the user's code
        error(f"the code castwise ran called sys.exit({exc.code!r}); nothing was checked")
        return EXIT_USAGE


def check_json_path(target: str | None) -> None:
    """Refuse an unwritable ``--json PATH`` before the work, not after it."""
    if target is None or target == "-":
        return
    path = Path(target)
    if path.is_dir():
        raise CastwiseError(f"--json {target}: is a folder; give a file path (or - for stdout)")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise CastwiseError(f"--json {target}: no folder {str(folder)!r}; create it or give another path")
    writable = os.access(path, os.W_OK) if path.exists() else os.access(folder, os.W_OK | os.X_OK)
    if not writable:
        raise CastwiseError(f"--json {target}: cannot write the report (permission denied); give another path")


def write_json(payload: str, target: str | None) -> None:
    if target is None:
        return
    if target == "-":
        click.echo(payload)
        return
    try:
        Path(target).write_text(payload + "\n", encoding="utf-8")
    except OSError as exc:
        raise CastwiseError(f"--json {target}: cannot write the report ({exc.strerror or exc})") from None


@contextlib.contextmanager
def user_stdout_aside(json_path: str | None) -> Iterator[None]:
    """With ``--json -``, what the user's code prints (a builder's ``number of parameters: 0.12M``,
    a forward's debug print) goes to stderr while it runs: stdout carries the JSON alone."""
    if json_path != "-":
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def emit(human: str, payload: str, json_path: str | None) -> None:
    """Human output on stdout unless the JSON goes there; the JSON where asked."""
    if json_path != "-":
        click.echo(human)
    write_json(payload, json_path)


def json_option(what: str = "report") -> Callable[[Any], Any]:
    return click.option("--json", "json_path", default=None, metavar="PATH|-", help=f"Write the JSON {what}.")


class DeviceChoice(click.ParamType):  # type: ignore[type-arg]  # generic only from click 8.2
    """A device from castwise's registry (``cpu``, ``cpu:avx2``, ``cuda``, ``cuda:a100``, ``cuda:0``...):
    the one list of devices, so the CLI never offers one the audit does not know."""

    name = "device"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        from castwise import devices

        return "[" + "|".join(devices.names()) + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from castwise import devices

        try:
            return devices.get(str(value)).name
        except CastwiseError:
            self.fail(f"{value!r} is not a device castwise knows; valid: {', '.join(devices.names())}", param, ctx)


class LazyGroup(click.Group):
    """A group whose subcommands are imported when used (``COMMANDS``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return None
        command = getattr(importlib.import_module(spec[0]), spec[1])
        if not isinstance(command, click.Command):  # a wrong entry in COMMANDS: castwise's bug
            raise TypeError(f"{spec[0]}.{spec[1]} is not a click command")
        return command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            if args and not args[0].startswith("-") and args[0] not in COMMANDS:
                raise click.UsageError(
                    f"no such command {args[0]!r}; valid commands: {', '.join(sorted(COMMANDS))}", ctx
                ) from exc
            raise


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": MAX_WIDTH})
@click.version_option(package_name="castwise")
def cli() -> None:
    """castwise: mixed precision in PyTorch, made boring."""


class _ImportNoise(logging.Filter):
    """torch's pytree logs a deprecation for each Enum torchao registers, on every import of
    torchao (which transformers' quantizers import): advice to torchao's maintainers, printed
    in castwise's own output. Dropped there; `castwise run` leaves the user's script as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


@contextlib.contextmanager
def _quiet_imports(argv: list[str]) -> Iterator[None]:
    if argv[:1] == ["run"]:
        yield
        return
    logger, noise = logging.getLogger("torch.utils._pytree"), _ImportNoise()
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)


def main(argv: list[str] | None = None) -> int:
    """The console script: run castwise with ``argv`` (default: the process's) and return the
    exit code."""
    try:
        with _quiet_imports(sys.argv[1:] if argv is None else argv):
            code = cli.main(args=argv, prog_name="castwise", standalone_mode=False)
    except click.exceptions.Abort:  # Ctrl-C while click itself was reading arguments
        return interrupted()
    except KeyboardInterrupt:
        return interrupted()
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except SystemExit as exc:  # a command that exits instead of returning its code
        if exc.code is None:
            return EXIT_OK
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return code if isinstance(code, int) else EXIT_OK


__all__ = [
    "COMMANDS",
    "EXIT_FINDINGS",
    "EXIT_INCOMPLETE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "check_json_path",
    "cli",
    "emit",
    "error",
    "guard",
    "main",
    "terminal_width",
    "user_stdout_aside",
    "write_json",
]
