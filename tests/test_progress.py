"""Progress on a terminal, nothing on a pipe (castwise._progress)."""

from __future__ import annotations

import os
import pty
import select
import time

from castwise._progress import progress


def _drain(fd: int, wait: float = 0.5) -> bytes:
    out = b""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the pty closed
                break
            if not chunk:
                break
            out += chunk
    return out


def test_a_terminal_shows_the_description_and_steps() -> None:
    master, slave = pty.openpty()
    with os.fdopen(slave, "w", encoding="utf-8") as tty:
        with progress("auditing llama-7b", total=2, stream=tty, delay=0) as p:
            assert p.shown
            p.advance()
            p.update("auditing eval mode")
            time.sleep(0.3)  # rich refreshes on its own thread
        shown = _drain(master)
    os.close(master)
    text = shown.decode("utf-8", "replace")
    assert "auditing" in text
    assert "\x1b[" in text  # terminal control codes: a live line, removed at the end


def test_a_pipe_gets_nothing() -> None:
    read, write = os.pipe()
    with os.fdopen(write, "w", encoding="utf-8") as pipe, progress("auditing", total=2, stream=pipe, delay=0) as p:
        assert not p.shown
        p.advance()
        p.update("still going")
    with os.fdopen(read, "rb") as fh:
        assert fh.read() == b""


def test_work_shorter_than_the_delay_shows_nothing_on_a_terminal() -> None:
    master, slave = pty.openpty()
    with os.fdopen(slave, "w", encoding="utf-8") as tty:
        with progress("quick audit", stream=tty, delay=5.0) as p:
            assert p.shown
        shown = _drain(master, 0.3)
    os.close(master)
    assert b"quick audit" not in shown


def test_work_longer_than_the_delay_appears_after_it() -> None:
    master, slave = pty.openpty()
    with os.fdopen(slave, "w", encoding="utf-8") as tty:
        with progress("slow audit", stream=tty, delay=0.2):
            early = _drain(master, 0.1)
            time.sleep(0.5)
        late = _drain(master, 0.3)
    os.close(master)
    assert b"slow audit" not in early
    assert b"slow audit" in early + late
