"""The script's own modules imported as on the simulated GPU (`castwise run --device cuda...`).

A dtype a codebase chooses when its module is imported (nanochat's
``COMPUTE_DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32``) is fixed before
any model exists: auditing for a GPU on a machine without one would audit the CPU's choice. While
the script runs, each of *its own* modules (a file under the script's folder, or the current
directory for ``-m``, outside site-packages) executes its top level with ``torch.cuda`` answering as
the simulated GPU does (``trace.simcuda.answering_as``), and torch's answers are restored as soon as
that module's top level has run. The script's own body (``__main__``), every library and every
call made later see this machine as it is: the run stays on this machine's device, and only what
those modules decided at import time follows the GPU.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

from castwise.devices import Device
from castwise.trace import simcuda

__all__ = ["imported_as_on", "imported_note", "own_module"]


def own_module(origin: str | None, root: str) -> bool:
    """A source file of the user's code base: under ``root`` and not an installed package's."""
    if not origin or not origin.endswith(".py"):
        return False
    path = os.path.realpath(origin)
    parts = set(path.split(os.sep))
    return path.startswith(os.path.realpath(root) + os.sep) and not parts & {"site-packages", "dist-packages"}


class _Loader(importlib.abc.Loader):
    """The module's own loader, its top level run under the simulated GPU's answers."""

    def __init__(self, inner: importlib.abc.Loader, device: Device, seen: list[str]) -> None:
        self._inner, self._device, self._seen = inner, device, seen

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._seen.append(module.__name__)
        with simcuda.answering_as(self._device):
            self._inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package...: the inner loader's
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str, device: Device) -> None:
        self.root, self.device = root, device
        self.seen: list[str] = []

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not own_module(spec.origin, self.root):
            return None  # the finders after this one import it as usual
        spec.loader = _Loader(spec.loader, self.device, self.seen)  # type: ignore[arg-type]
        return spec


@contextlib.contextmanager
def imported_as_on(device: Device | None, root: str) -> Iterator[list[str]]:
    """While it is open, the modules under ``root`` imported for the first time run their top level
    as on ``device`` (a simulated CUDA GPU; anything else: nothing changes). Yields the names of the
    modules so imported, filled in as the script runs."""
    if device is None or device.kernels != "cuda" or device.capability is None:
        yield []
        return
    finder = _Finder(root, device)
    sys.meta_path.insert(0, finder)
    try:
        yield finder.seen
    finally:
        sys.meta_path.remove(finder)


def imported_note(device: Device, own: Sequence[str]) -> str:
    """What `castwise run` says of the modules :func:`imported_as_on` imported as on ``device``."""
    sm = ".".join(str(v) for v in device.capability or ())
    return (
        f"the script's own modules ({', '.join(own)}) ran their top level with torch.cuda answering as "
        f"{device.name} (is_available, capability sm {sm}), so what they chose at import (a compute dtype) is "
        "the GPU's; the script itself ran on this machine"
    )
