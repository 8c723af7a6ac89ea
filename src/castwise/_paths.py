"""Paths as a user reads them (torch-free)."""

from __future__ import annotations

import os


def short_path(path: str) -> str:
    """Relative to the working directory when under it, else from site-packages on
    ("transformers/models/t5/modeling_t5.py")."""
    cwd = os.getcwd() + os.sep
    if path.startswith(cwd):
        return path[len(cwd) :]
    marker = f"site-packages{os.sep}"
    at = path.find(marker)
    return path[at + len(marker) :] if at >= 0 else path
