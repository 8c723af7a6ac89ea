"""`castwise explain [FILE|-]`: an error message, traceback or log -> its cause and fix.

Never imports torch. What is read is capped on every path: an endless or huge input (``/dev/zero``,
a multi-GB log, ``yes |``) stops at ``MAX_BYTES`` instead of filling memory, and is read in
chunks so Ctrl-C is honoured while reading.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import BinaryIO

import click

from castwise.cli import EXIT_OK, check_json_path, emit, guard, json_option, terminal_width
from castwise.errors import CastwiseError

# Error messages and tracebacks are KBs; the end of a long log is what holds the error.
MAX_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024


def _read_capped(stream: BinaryIO, shown: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total <= MAX_BYTES:
        chunk = stream.read(min(_CHUNK, MAX_BYTES + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
    raise CastwiseError(
        f"{shown}: more than {MAX_BYTES // 2**20} MiB of input; castwise explain reads an error message, a "
        "traceback or the end of a log: pass the end (tail -n 300 train.log | castwise explain -)"
    )


def read_input(file: str) -> str:
    """The text to explain: stdin for ``-``; a file's last 4 MiB when it is a larger regular file
    (a long log ends with its error); at most 4 MiB from anything else (a device, a pipe)."""
    if file == "-":
        return _read_capped(sys.stdin.buffer, "stdin").decode("utf-8", errors="replace")
    path = Path(file)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise CastwiseError(f"{file}: no such file") from None
    if stat.S_ISDIR(info.st_mode):
        raise CastwiseError(f"{file}: is a folder; give the file holding the error (or - for stdin)")
    with path.open("rb") as fh:
        if stat.S_ISREG(info.st_mode) and info.st_size > MAX_BYTES:
            click.echo(
                f"castwise: note: {file} is {info.st_size / 2**20:,.0f} MiB; reading its last {MAX_BYTES // 2**20} MiB",
                err=True,
            )
            fh.seek(info.st_size - MAX_BYTES, os.SEEK_SET)
        data = _read_capped(fh, file)
    return data.decode("utf-8", errors="replace")


@click.command()
@click.argument("file", required=False, default="-")
@json_option("explanation")
def explain(file: str, json_path: str | None) -> int:
    """Explain a dtype error: FILE holds an error message, traceback or log (- for stdin)."""

    def body() -> int:
        import json

        from castwise.diagnosis.explain import explain as run_explain
        from castwise.diagnosis.explain import render

        check_json_path(json_path)
        result = run_explain(read_input(file))
        emit(render(result, terminal_width()), json.dumps(result.to_dict(), indent=2), json_path)
        return EXIT_OK

    return guard(body)
