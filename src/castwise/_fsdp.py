"""FSDP2's API where this torch release keeps it: ``torch.distributed.fsdp`` from torch 2.6,
``torch.distributed._composable.fsdp`` in 2.5 (docs/torch.md)."""

from __future__ import annotations

import sys
import types

_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def api() -> types.ModuleType:
    """The module with ``FSDPModule``, ``fully_shard`` and ``MixedPrecisionPolicy``."""
    import torch.distributed.fsdp as public

    if hasattr(public, "FSDPModule"):
        return public
    import torch.distributed._composable.fsdp as composable

    return composable


def imported() -> bool:
    """Whether FSDP2 was imported at all (nothing can be sharded by it otherwise)."""
    return any(name in sys.modules for name in _MODULES)
