"""A map from the audit's own tensors to a value, kept on the tensor object itself."""

from __future__ import annotations

import itertools
from typing import Any

import torch

_KEYS = itertools.count()


class AttrMap:
    """tensor -> value, kept in the tensor object's own ``__dict__`` under a key unique to this
    map. Only the audit's own tensors (its fake or real copies) are ever keys. A dict hit per
    lookup, where a WeakIdKeyDictionary makes a weak reference per lookup (measured: the
    difference is a sizeable part of the tracer's cost on a 7B model)."""

    def __init__(self, what: str) -> None:
        self.key = f"_castwise_{what}_{next(_KEYS)}"

    def get(self, t: torch.Tensor, default: Any = None) -> Any:
        return t.__dict__.get(self.key, default)

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.key in t.__dict__

    def __setitem__(self, t: torch.Tensor, value: Any) -> None:
        t.__dict__[self.key] = value
