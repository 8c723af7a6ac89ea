"""What FSDP2 reduces each parameter's gradient in, read from the sharded model (imports torch).

``fully_shard`` keeps, per parameter, an ``FSDPParam`` whose ``init_dtype_attrs`` (torch
distributed/fsdp/_fully_shard/_fsdp_param.py) sets, at the root's lazy init before the first
forward: ``orig_dtype`` (the sharded parameter's, which the sharded ``.grad`` is kept in),
``param_dtype`` (the dtype gathered and computed in; None: the original) and ``reduce_dtype``
(None: the compute dtype). The reduce-scatter sums the ranks' gradients in the reduce dtype and the
result is cast to ``orig_dtype`` (``foreach_reduce``). Read without any collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["reduce_dtypes"]


def _groups(module: nn.Module) -> list[Any]:
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return []
    try:
        state = get()
    except (AssertionError, AttributeError, RuntimeError):
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        try:
            groups = [state._fsdp_param_group]
        except (AssertionError, AttributeError, RuntimeError):
            return []
    return [g for g in groups if g is not None]


def reduce_dtypes(roots: Iterable[nn.Module]) -> dict[int, tuple[torch.dtype, torch.dtype]]:
    """id(sharded parameter) -> (the dtype its gradient is computed in, the dtype it is reduced
    in), for each parameter FSDP2 has initialized under ``roots``."""
    out: dict[int, tuple[torch.dtype, torch.dtype]] = {}
    for root in roots:
        for m in root.modules():
            for g in _groups(m):
                for fp in getattr(g, "fsdp_params", None) or []:
                    orig = getattr(fp, "orig_dtype", None)
                    if not isinstance(orig, torch.dtype):
                        continue  # not initialized yet (before the first forward)
                    compute = fp.param_dtype or orig
                    out[id(fp.sharded_param)] = (compute, fp.reduce_dtype or compute)
    return out
