"""aten ops looked up by name, tolerant of the torch release.

castwise supports a range of torch releases (docs/torch.md), and ops come and go between them
(``aten._grouped_mm`` is new in 2.8). Every module-level reference to an op that not every
supported release has goes through here: an op this torch lacks is None, or left out of a list,
instead of an AttributeError when castwise is imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_aten = torch.ops.aten


def op(name: str, overload: str = "default") -> Any | None:
    """``torch.ops.aten.<name>.<overload>``, or None where this torch has no such op."""
    packet = getattr(_aten, name, None)  # torch.ops raises AttributeError for an unknown name
    return getattr(packet, overload, None) if packet is not None else None


def ops(names: Iterable[str], overload: str = "default") -> list[Any]:
    """The ``overload`` of each op in ``names`` that this torch has."""
    return [o for o in (op(n, overload) for n in names) if o is not None]


def overloads(names: Iterable[str], *, out: bool = True) -> list[Any]:
    """Every overload of each op in ``names`` that this torch has (``out=False``: without the
    ``out=`` variants, which write into a tensor the caller gives)."""
    found = []
    for name in names:
        packet = getattr(_aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            if out or (overload != "out" and not overload.endswith("_out")):
                found.append(getattr(packet, overload))
    return found
