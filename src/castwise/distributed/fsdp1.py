"""Reading a model wrapped by FSDP1 (``FullyShardedDataParallel``) for the distributed audit.

FSDP1 keeps the parameters of each wrapper in one flat tensor, sharded over the ranks; it gathers
them in its ``MixedPrecision.param_dtype`` for forward and backward, casts the floating buffers
to their owning wrapper's ``buffer_dtype`` at the root's first forward, and casts the root's
floating inputs to ``param_dtype`` (``cast_root_forward_inputs``; every wrapper's with
``cast_forward_inputs``). Modules of ``_module_classes_to_ignore`` (batch norm, by default) get a
wrapper of their own with mixed precision off: their inputs are cast to f32 and their outputs
back to the dtype the inputs came in. What the model computes is therefore the unwrapped module
tree in those dtypes, which the distributed audit builds as its view (audit.py) from what this
module reads: the wrappers' units, each original parameter's shape and gather dtype, each
buffer's dtype.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from castwise.distributed.plan import UnitPlan

if TYPE_CHECKING:
    from torch import nn

_WRAPPED = "_fsdp_wrapped_module"


@dataclass(frozen=True)
class OriginalParam:
    """A parameter as the user's module had it before FSDP1 flattened it."""

    shape: tuple[int, ...]
    gather: torch.dtype  # the dtype the module computes with
    requires_grad: bool
    key: tuple[int, int]  # (flat parameter, index in it): shared parameters share one key


@dataclass(frozen=True)
class Wrapped:
    """What FSDP1 does to a model, read from its wrappers."""

    units: list[UnitPlan]  # one per wrapper, innermost first, the root last
    params: dict[int, dict[str, OriginalParam]]  # id(module) -> its original parameters by name
    buffers: dict[int, torch.dtype]  # id(buffer) -> the dtype the root casts it to
    restore: frozenset[str]  # units whose outputs go back to the dtype their inputs came in
    world: int
    reshards: dict[str, bool | None]  # unit -> frees its parameters after forward (None: never sharded)


def is_wrapped(model: Any) -> bool:
    """Whether ``model`` (or a module in it) is wrapped by FSDP1. Cheap when FSDP was never imported."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, nn.Module) and any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module an FSDP1 wrapper holds (``module`` itself when it is no wrapper)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    while isinstance(module, FullyShardedDataParallel):
        module = getattr(module, _WRAPPED)
    return module


def clean(name: str) -> str:
    """A module name as the user wrote the model: without FSDP1's wrapper levels."""
    return ".".join(part for part in name.split(".") if part != _WRAPPED)


def read(model: nn.Module) -> Wrapped:
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrappers = [(clean(n), m) for n, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]
    params: dict[int, dict[str, OriginalParam]] = {}
    buffers: dict[int, torch.dtype] = {}
    units: list[UnitPlan] = []
    restore: set[str] = set()
    reshards: dict[str, bool | None] = {}
    root_name = wrappers[0][0] if wrappers else ""
    # innermost first, so a buffer takes its owning (innermost) wrapper's buffer_dtype, as FSDP1 does
    for name, wrapper in sorted(wrappers, key=lambda w: -len(w[0].split(".")) if w[0] else 1):
        mp = wrapper.mixed_precision
        flat = wrapper._handle.flat_param if wrapper._handle is not None else None
        stored = flat.dtype if flat is not None else None
        gather = mp.param_dtype or stored or torch.float32
        numel = 0
        if flat is not None:
            originals = list(flat._params) if flat._params is not None else None
            for i, (info, shape) in enumerate(zip(flat._param_infos, flat._shapes, strict=True)):
                grad = originals[i].requires_grad if originals is not None else flat.requires_grad
                params.setdefault(id(info.module), {})[info.param_name] = OriginalParam(
                    tuple(shape), gather, bool(grad), (id(flat), i)
                )
                numel += int(torch.Size(shape).numel())
            for shared in flat._shared_param_infos:
                prim = params[id(shared.prim_module)][shared.prim_param_name]
                params.setdefault(id(shared.module), {})[shared.param_name] = prim
        inner = unwrap(wrapper)
        ignored = getattr(inner, "_wrap_overrides", None) is not None and mp.param_dtype is None
        skipped = wrapper._ignored_buffer_names
        for buf_name, buf in inner.named_buffers():
            if id(buf) not in buffers and buf.is_floating_point() and clean(buf_name) not in skipped:
                buffers[id(buf)] = mp.buffer_dtype or buf.dtype
        is_root = name == root_name
        strategy = str(getattr(wrapper._handle, "_sharding_strategy", "")) if wrapper._handle is not None else ""
        # FULL_SHARD and HYBRID_SHARD free after forward, SHARD_GRAD_OP keeps; NO_SHARD never shards
        reshards[name] = None if strategy.endswith("NO_SHARD") else strategy.endswith(("FULL_SHARD", ".HYBRID_SHARD"))
        casts = mp.cast_forward_inputs or (is_root and mp.cast_root_forward_inputs)
        inputs = torch.float32 if ignored else (mp.param_dtype if casts else None)
        if ignored:
            restore.add(name)
        units.append(
            UnitPlan(
                name=name,
                kind="root" if is_root else ("island" if ignored else "unit"),
                params=numel,
                stored=stored,
                gather=gather,
                compute=gather,
                reduce=mp.reduce_dtype or gather,
                output=None,
                inputs=inputs,
                reason="FSDP1: mixed precision off (_module_classes_to_ignore)" if ignored else "torch FSDP1",
            )
        )
    world = int(wrappers[0][1].world_size) if wrappers else 1
    return Wrapped(units, params, buffers, frozenset(restore), world, reshards)


__all__ = ["OriginalParam", "Wrapped", "clean", "is_wrapped", "read", "unwrap"]
