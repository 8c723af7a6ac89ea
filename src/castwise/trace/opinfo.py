"""What the tracer needs to know about an op, worked out once per op and cached.

The tracer's handler runs for every op of an audit (hundreds of thousands on a 405B model). An
``OpOverload``'s ``__hash__`` is Python code, so each ``func in some_set`` costs a Python call:
:func:`info_of` answers every per-op question about ``func`` with one dict hit keyed by its id.
"""

from __future__ import annotations

from typing import Any

import torch

from castwise.trace import fastpath

_aten = torch.ops.aten
PRIM_DEVICE = torch.ops.prim.device.default  # asked for by C++ on every fake tensor: passed through
_SCALAR = (_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default)
_TO_COPY = _aten._to_copy.default


class OpInfo:
    """One op's fixed facts. A plain slotted object: read on the hot path."""

    __slots__ = ("fast", "func", "fused", "is_view", "name", "rnn", "scalar", "to_copy")

    def __init__(self, func: Any) -> None:
        self.func = func  # kept: the cache is keyed by its id
        self.name = fastpath.op_name(func)  # "aten.addmm"
        self.scalar = any(func is s for s in _SCALAR)  # a Python value out (a truth value, an item)
        self.fast = func in fastpath.HANDLED  # a fused fast-path op (trace/fastpath.py)
        self.fused = func in fastpath.FUSED
        self.rnn = func in fastpath.RNN_CONTRACT
        self.to_copy = func is _TO_COPY
        self.is_view = bool(getattr(func, "is_view", False))


_INFO: dict[int, OpInfo] = {}


def info_of(func: Any) -> OpInfo:
    """The cached :class:`OpInfo` of ``func``."""
    found = _INFO.get(id(func))
    if found is None:
        found = _INFO[id(func)] = OpInfo(func)
    return found
