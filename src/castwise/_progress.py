"""Progress for long work in a terminal: a spinner (or a bar) on a tty, nothing on a pipe.

    with progress("auditing on fake tensors", delay=2.0) as p:
        ...
        p.update("auditing eval mode")
        p.advance()

Uses rich, imported only when stderr is a terminal, so ``import castwise`` stays light and
output piped to a file or another program carries no control codes. Work that ends within
``delay`` seconds shows nothing at all (no flicker for fast audits); the line is removed when
the work ends.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO


class Progress:
    """What the work reports; does nothing when nothing is shown."""

    def __init__(self, bar: Any = None, task: Any = None) -> None:
        self._bar = bar
        self._task = task

    @property
    def shown(self) -> bool:
        """True when the progress goes to a terminal."""
        return self._bar is not None

    def update(self, description: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=description)

    def advance(self, steps: float = 1.0) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, steps)


def is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or unusual stream is no terminal
        return False


@contextmanager
def progress(
    description: str, *, total: float | None = None, stream: TextIO | None = None, delay: float = 2.0
) -> Iterator[Progress]:
    """Show ``description`` with a spinner (or a bar out of ``total``) on ``stream`` (default
    stderr) while the block runs, if ``stream`` is a terminal and the block lasts over ``delay``
    seconds; otherwise write nothing."""
    out = sys.stderr if stream is None else stream
    if not is_terminal(out):
        yield Progress()
        return
    from rich.console import Console
    from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as RichProgress

    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns.append(BarColumn())
    columns.append(TimeElapsedColumn())
    bar = RichProgress(*columns, console=Console(file=out), transient=True)
    task = bar.add_task(description, total=total)
    lock = threading.Lock()
    state = {"started": False, "done": False}

    def start() -> None:
        with lock:
            if not state["done"]:
                bar.start()
                state["started"] = True

    timer = threading.Timer(delay, start) if delay > 0 else None
    if timer is None:
        start()
    else:
        timer.daemon = True
        timer.start()
    try:
        yield Progress(bar, task)
    finally:
        if timer is not None:
            timer.cancel()
        with lock:
            state["done"] = True
            if state["started"]:
                bar.stop()
