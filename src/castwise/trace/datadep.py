"""Ops whose output size depends on values, run on fake tensors with concrete sizes.

Fake tensors have no values, so torch's fake kernels refuse ``x[mask]``, ``x[mask] = v``
(``index_put`` with a bool mask), ``nonzero``, ``masked_select``, ``repeat_interleave`` with tensor
repeats, ``unique`` and ``bincount``: the audit would stop there (CW902) and miss what comes after, e.g. the
masked write of an f32 tensor into a bf16 one that the real kernel refuses.

Each runs here with a concrete size instead. The values come from ``values.known`` (trace/values.py):
the input's shadow, or its values computed from what made it; where nobody knows them, a mask is
taken as all True, repeat counts as 1 and ``unique``'s elements as all distinct (the largest
result), and the assumption is recorded for CW903. Masks become long indices, so the dtype checks
stay the real kernel's: the contract table sees the op with its original operands before it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from castwise import _aten as aten
from castwise.trace.values import _SHADOW_MAX, ShadowValues

_MASKS = (torch.bool, torch.uint8)
_ALL_TRUE = "a mask with unknown values taken as all True"


def _name(func: Any) -> str:
    return f"{func.namespace}.{func._opname}"


def _mask_value(values: ShadowValues, func: Any, mask: torch.Tensor) -> torch.Tensor | None:
    """The mask's real values (an unknown one taken as all True, recorded); None when it is too
    large to compute: then it is taken as all True without materialising it."""
    before = values.assumed_now
    value: torch.Tensor | None = values.known(mask, assume=True)
    if value is None or values.assumed_now != before:
        values.note_assumption(_name(func), _ALL_TRUE, tuple(mask.shape))
    return value


def _seed(values: ShadowValues, fake: torch.Tensor, real: torch.Tensor) -> None:
    if real.numel() <= _SHADOW_MAX:
        values.seed_values([(fake, real)])


def _coords(values: ShadowValues, func: Any, mask: torch.Tensor) -> list[torch.Tensor]:
    """The long index tensors a k-dim mask stands for (as torch's ``expandTensors`` makes them)."""
    value = _mask_value(values, func, mask)
    if value is None:
        n = mask.numel()
        return [mask.new_empty((n,), dtype=torch.int64) for _ in range(mask.dim())]
    with _disable_current_modes():
        real = value.nonzero()
    out = []
    for j in range(mask.dim()):
        fake = mask.new_empty((real.shape[0],), dtype=torch.int64)
        with _disable_current_modes():
            column = real[:, j].contiguous()
        _seed(values, fake, column)
        out.append(fake)
    return out


def _expand(values: ShadowValues, func: Any, self_: torch.Tensor, indices: Any) -> list[torch.Tensor | None] | None:
    """``indices`` with every bool/byte mask replaced by its long indices; None: no mask (or a
    0-dim one, which torch itself must handle)."""
    if not any(i is not None and i.dtype in _MASKS for i in indices):
        return None
    out: list[torch.Tensor | None] = []
    for i in indices:
        if i is None or i.dtype not in _MASKS:
            out.append(i)
            continue
        if i.dim() == 0:
            return None
        start = len(out)
        for d in range(i.dim()):
            # torch's own check (IndexingUtils.h): the mask covers the dims it indexes
            if start + d >= self_.dim() or i.shape[d] != self_.shape[start + d]:
                raise IndexError(
                    f"The shape of the mask {list(i.shape)} at index {d} does not match the shape of the "
                    f"indexed tensor {list(self_.shape)} at index {start + d}"
                )
        out.extend(_coords(values, func, i))
    return out


def run_index(values: ShadowValues, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x[mask]``: the mask becomes long indices of its True positions."""
    indices = _expand(values, func, args[0], args[1])
    if indices is None:
        return func(*args, **kwargs)
    return func(args[0], indices, *args[2:], **kwargs)


def run_index_put(values: ShadowValues, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x[mask] = v`` (``index_put``, in place or not, accumulating or not, and the backward of
    ``x[mask]``): the mask becomes long indices; the dtype contract was checked before."""
    indices = _expand(values, func, args[0], args[1])
    if indices is None:
        return func(*args, **kwargs)
    return func(args[0], indices, *args[2:], **kwargs)


def run_nonzero(values: ShadowValues, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nonzero``: the exact size from known values; without them every element is taken as
    nonzero (the largest result: every expert of an eager MoE loop runs), and the result gets the
    values that assumption gives it (so indexing with it later knows its values too)."""
    x = args[0]
    before = values.assumed_now
    value = values.known(x, assume=True)
    if value is None or values.assumed_now != before:
        values.note_assumption(_name(func), "every element taken as nonzero", tuple(x.shape))
    if value is None and x.numel() > _SHADOW_MAX:
        return x.new_empty((x.numel(), x.dim()), dtype=torch.int64)
    with _disable_current_modes():
        real = (value if value is not None else torch.ones(tuple(x.shape), dtype=torch.bool)).nonzero()
    out = x.new_empty(tuple(real.shape), dtype=torch.int64)
    _seed(values, out, real)
    return out


def run_masked_select(values: ShadowValues, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``masked_select``: as many elements as the (broadcast) mask has True."""
    self_, mask = args[0], args[1]
    shape = torch.broadcast_shapes(self_.shape, mask.shape)  # type: ignore[no-untyped-call]
    value = _mask_value(values, func, mask)
    if value is None:
        n = shape.numel()
    else:
        with _disable_current_modes():
            n = int(value.expand(shape).count_nonzero())
    return self_.new_empty((n,))


def run_repeat_interleave(values: ShadowValues, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``repeat_interleave`` with tensor repeats: the index tensor it makes, from the repeats'
    values (unknown ones taken as 1 each, recorded)."""
    repeats = args[0]
    size = args[1] if len(args) > 1 else kwargs.get("output_size")
    if size is not None:
        return func(*args, **kwargs)
    value = values.known(repeats, assume=False)
    if value is None:
        values.note_assumption(_name(func), "repeat counts with unknown values taken as 1", tuple(repeats.shape))
        with _disable_current_modes():
            value = torch.ones(tuple(repeats.shape), dtype=repeats.dtype)
    with _disable_current_modes():
        real = torch.repeat_interleave(value)
    out = repeats.new_empty(tuple(real.shape), dtype=torch.int64)
    _seed(values, out, real)
    return out


def run_unique(values: ShadowValues, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``unique`` family: run for real on the known values; without them on a stand-in whose
    elements are all distinct (the largest result), recorded."""
    x = args[0]
    value = values.known(x, assume=False)
    if value is None:
        values.note_assumption(_name(func), "elements with unknown values taken as all distinct", tuple(x.shape))
        with _disable_current_modes():
            # a cast in the stand-in only: its values are distinct positions, in the input's dtype
            value = torch.arange(x.numel()).reshape(tuple(x.shape)).to(x.dtype)
    with _disable_current_modes():
        reals = func(value, *args[1:], **kwargs)
    outs = []
    for r in reals:
        fake = x.new_empty(tuple(r.shape), dtype=r.dtype)
        _seed(values, fake, r)
        outs.append(fake)
    return tuple(outs)


def run_bincount(values: ShadowValues, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``bincount``: as long as the largest known value + 1 (at least ``minlength``); unknown
    values are taken as below ``minlength`` (ids of that many bins), or as all distinct without
    one, recorded."""
    x = args[0]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = int(args[2] if len(args) > 2 else kwargs.get("minlength", 0))
    value = values.known(x, assume=False)
    if value is None:
        what = f"ids with unknown values taken as below minlength={minlength}" if minlength > 0 else None
        values.note_assumption(_name(func), what or "ids with unknown values taken as all distinct", tuple(x.shape))
        with _disable_current_modes():
            value = torch.zeros(tuple(x.shape), dtype=x.dtype) if minlength > 0 else torch.arange(x.numel())
    with _disable_current_modes():
        # stand-in weights: only their dtype and shape decide the result's
        w = None if weights is None else torch.ones(tuple(weights.shape), dtype=weights.dtype)
        real = torch.bincount(value, weights=w, minlength=minlength)
    out = x.new_empty(tuple(real.shape), dtype=real.dtype)
    if weights is None:
        _seed(values, out, real)
    return out


Impl = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]
# ops whose output size depends on values: castwise's implementation runs instead of torch's fake
# kernel during a fake audit (after the contract table checked the op as the user called it)
OWN_FAKE: dict[Any, Impl] = {
    **dict.fromkeys(aten.ops(["index"], "Tensor"), run_index),
    **dict.fromkeys(
        aten.overloads(["index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"], out=False), run_index_put
    ),
    **dict.fromkeys(aten.ops(["nonzero"]), run_nonzero),
    **dict.fromkeys(aten.ops(["masked_select"]), run_masked_select),
    **dict.fromkeys(aten.ops(["repeat_interleave"], "Tensor"), run_repeat_interleave),
    **dict.fromkeys(aten.ops(["bincount"]), run_bincount),
    **dict.fromkeys(aten.overloads(["_unique", "_unique2", "unique_dim", "unique_consecutive"], out=False), run_unique),
}
