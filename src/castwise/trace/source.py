"""The user's line: the first stack frame outside torch, library plumbing and castwise.

Captured only where a tensor's dtype is made (a factory op without dtype, an explicit cast, a
dtype-changing op), never for every op: a frame walk costs microseconds, and a 7B audit runs
hundreds of thousands of ops.
"""

from __future__ import annotations

import linecache
import os
import sys

from castwise._paths import short_path

# path fragments of frames that are never the user's line
_PLUMBING = (
    f"{os.sep}torch{os.sep}",
    f"{os.sep}castwise{os.sep}",
    f"{os.sep}transformers{os.sep}utils{os.sep}",
    f"{os.sep}transformers{os.sep}integrations{os.sep}",
    f"transformers{os.sep}modeling_utils.py",
    f"{os.sep}accelerate{os.sep}hooks.py",
    f"{os.sep}contextlib.py",
    f"{os.sep}functools.py",
    "<frozen ",
)


def is_plumbing(path: str) -> bool:
    """A file that is never the user's line (torch, castwise, library plumbing)."""
    return any(p in path for p in _PLUMBING)


def user_frame(skip: int = 1) -> tuple[str, int] | None:
    """(file, line) of the innermost frame that is the user's code (or a model library's
    modeling code), or None."""
    try:
        frame = sys._getframe(skip)
    except ValueError:
        return None
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(p in name for p in _PLUMBING):
            return name, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


def where(skip: int = 1) -> str | None:
    """``"models/rope.py:42"`` for the user's frame, or None."""
    found = user_frame(skip + 1)
    return f"{short_path(found[0])}:{found[1]}" if found else None


def line_text(path: str, line: int) -> str | None:
    """The text of a source line (None when the file cannot be read)."""
    text = linecache.getline(path, line)
    return text.rstrip("\n") if text else None


__all__ = ["is_plumbing", "line_text", "short_path", "user_frame", "where"]
