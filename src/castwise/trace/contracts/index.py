"""Contracts for embeddings, indexing, scatter/gather, masks and losses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from castwise.devices import Device
from castwise.trace.contracts._base import (
    _INDEX_TYPES,
    BOOL,
    CPU_CHECKS_BEFORE_2_12,
    F32,
    F64,
    I32,
    I64,
    U8,
    Args,
    Kwargs,
    Tensor,
    Violation,
    _arg,
    _cpp,
    _legacy,
    _sc,
    _scalar,
    _viol,
    result_type,
)


def _embedding(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # embedding(weight, indices) / embedding_(dense_)backward(grad, indices): weight's or grad's dtype
    idx = args[1]
    if idx.dtype not in _INDEX_TYPES:
        number, checked = ("#2", "embedding_backward") if op.endswith("_backward") else ("#1", "embedding")
        return _viol(
            op,
            "index",
            f"Expected tensor for argument {number} 'indices' to have one of the following scalar "
            f"types: Long, Int; but got {_legacy(idx.dtype, dev)} instead (while checking arguments for "
            f"{checked})",
            args,
            kwargs,
            [idx],
            I64,
        )
    return args[0].dtype


def _check_indices(op: str, args: Args, kwargs: Kwargs, indices: Sequence[Tensor | None]) -> Violation | None:
    for i in indices:
        if i is not None and i.dtype not in (I64, I32, U8, BOOL):
            return _viol(
                op, "index", "tensors used as indices must be long, int, byte or bool tensors", args, kwargs, [i], I64
            )
    return None


def _index_put(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, indices, values = args[0], args[1], args[2]
    v = _check_indices(op, args, kwargs, indices)
    if v:
        return v
    if values.dtype != s.dtype:
        msg = (
            # CUDA's in-place kernel reads values as self's type (measured, H100)
            f"expected scalar type {_sc(values.dtype)} but found {_sc(s.dtype)}"
            if dev.kernels == "cuda" and op == "aten.index_put_" and values.dim() > 0
            else f"Index put requires the source and destination dtypes match, got "
            f"{_sc(s.dtype)} for the destination and {_sc(values.dtype)} for the source."
        )
        return _viol(
            op,
            "index",
            msg,
            args,
            kwargs,
            [values],
            s.dtype,
        )
    return s.dtype


def _index(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _check_indices(op, args, kwargs, args[1]) or args[0].dtype


def _masked_scatter(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, mask, src = args[0], args[1], args[2]
    if mask.dtype != BOOL:
        return _viol(
            op,
            "mask",
            f"masked_scatter_ only supports boolean masks, but got mask with dtype "
            f"{_cpp(mask.dtype) if dev.kernels == 'cuda' else _sc(mask.dtype)}",
            args,
            kwargs,
            [mask],
            BOOL,
        )
    if src.dtype != s.dtype:
        return _viol(
            op,
            "index",
            (
                f"masked_scatter_: expected self and source to have same dtypes but got {_sc(s.dtype)} and "
                if dev.kernels == "cuda"  # measured, H100
                else f"masked_scatter: expected self and source to have same dtypes but got{_sc(s.dtype)} and "
            )
            + _sc(src.dtype),
            args,
            kwargs,
            [src],
            s.dtype,
        )
    return s.dtype


def _masked_fill(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, mask, value = args[0], args[1], args[2]
    if mask.dtype != BOOL:
        return _viol(
            op,
            "mask",
            (
                f"masked_fill only supports boolean masks, but got dtype {_sc(mask.dtype)}"
                if dev.kernels == "cuda" and op == "aten.masked_fill"  # measured, H100
                else f"masked_fill_ only supports boolean masks, but got mask with dtype {_cpp(mask.dtype)}"
            ),
            args,
            kwargs,
            [mask],
            BOOL,
        )
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        return _viol(
            op,
            "mask",
            f"masked_fill_ only supports a 0-dimensional value tensor, but got tensor with {value.dim()} dimension(s).",
            args,
            kwargs,
            [value],
            None,
        )
    return s.dtype  # the value is cast to self's dtype


def _scatter(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index = args[0], args[2]
    src = args[3] if len(args) > 3 else kwargs.get("src")
    if index.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "scatter(): Expected dtype int32/int64 for index", args, kwargs, [index], I64)
    if isinstance(src, torch.Tensor) and src.dtype != s.dtype:
        return _viol(
            op, "index", "scatter(): Expected self.dtype to be equal to src.dtype", args, kwargs, [src], s.dtype
        )
    return s.dtype


def _gather(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index = args[0], args[2]
    if index.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "gather(): Expected dtype int32/int64 for index", args, kwargs, [index], I64)
    return s.dtype


def _index_select(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index = args[0], args[2]
    if index.dtype not in _INDEX_TYPES:
        msg = (
            f"\"index_select_out_cuda_impl\" not implemented for '{_sc(index.dtype)}'"
            if dev.kernels == "cuda"  # measured, H100: the dispatch fails before the check
            else "index_select(): Expected dtype int32 or int64 for index"
        )
        return _viol(op, "index", msg, args, kwargs, [index], I64)
    return s.dtype


def _index_copy(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index, src = args[0], args[2], args[3]
    if index.dtype != I64:
        return _viol(
            op,
            "index",
            f"index_copy_(): Expected a long tensor for index, but got {_sc(index.dtype)}",
            args,
            kwargs,
            [index],
            I64,
        )
    if src.dtype != s.dtype:
        return _viol(
            op,
            "index",
            f"index_copy_(): self and source expected to have the same dtype, but got (self) "
            f"{_sc(s.dtype)} and (source) {_sc(src.dtype)}",
            args,
            kwargs,
            [src],
            s.dtype,
        )
    return s.dtype


def _index_add(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index, src = args[0], args[2], args[3]
    if index.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "index_add_(): Expected dtype int32/int64 for index", args, kwargs, [index], I64)
    if src.dtype != s.dtype:
        return _viol(
            op,
            "index",
            f"index_add_(): self ({_sc(s.dtype)}) and source ({_sc(src.dtype)}) must have the same scalar type",
            args,
            kwargs,
            [src],
            s.dtype,
        )
    return s.dtype


def _where(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    cond = args[0]
    if cond.dtype not in (BOOL, U8):  # uint8 still accepted, with a deprecation warning
        return _viol(
            op,
            "mask",
            f"where expected condition to be a boolean tensor, but got a tensor with dtype {_sc(cond.dtype)}",
            args,
            kwargs,
            [cond],
            BOOL,
        )
    return result_type(args[1:3])


# ---------------------------------------------------------------------------------------------
# losses (Loss.cpp, LossNLL.cpp; CPU measured, the checks are device-agnostic)


def _loss_input(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # huber_loss / mse_loss_backward / smooth_l1_loss_backward return the input's dtype
    if (dev.kernels == "cuda" or CPU_CHECKS_BEFORE_2_12) and op == "aten.mse_loss_backward":
        # CUDA (measured, H100): one TensorIterator over grad, input and target, no promotion
        return _loss_same(op, args, kwargs, dev)
    return (args[1] if op.endswith("_backward") else args[0]).dtype


def _loss_target(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return args[1].dtype  # binary_cross_entropy_with_logits computes in the target's dtype (measured)


def _loss_same(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # binary_cross_entropy(input, target, ...) / huber_loss_backward(grad, input, target, ...)
    backward = op.endswith("_backward")
    x = args[1] if backward else args[0]
    others = [args[0], args[2]] if backward else [args[1]]
    bad = [a for a in others if isinstance(a, torch.Tensor) and a.dtype != x.dtype]
    if bad:
        return _viol(
            op, "mismatch", f"Found dtype {_sc(bad[0].dtype)} but expected {_sc(x.dtype)}", args, kwargs, bad, x.dtype
        )
    return x.dtype


def _nll_check(op: str, args: Args, kwargs: Kwargs, dev: Device, x: Tensor, target: Tensor, others: Args) -> Any:
    """nll_loss's checks, forward and backward: the target's dtype, then ``others`` (weight; the
    backward's grad and total_weight too) in the input's dtype."""
    if target.dtype not in (I64, U8):
        if dev.kernels == "cuda" and x.dim() == 2:  # measured, H100: the kernel's dispatch fails
            msg = f"\"nll_loss_forward_reduce_cuda_kernel_2d_index\" not implemented for '{_sc(target.dtype)}'"
        elif dev.kernels != "cuda" and CPU_CHECKS_BEFORE_2_12:
            msg = f"expected scalar type Long but found {_sc(target.dtype)}"
        else:
            msg = f"expected target dtype to be Long or Byte, but got {_sc(target.dtype)}"
        return _viol(op, "index", msg, args, kwargs, [target], I64)
    bad = [a for a in others if isinstance(a, torch.Tensor) and a.dtype != x.dtype]
    return _scalar(op, "mismatch", args, kwargs, x.dtype, bad) if bad else x.dtype


def _nll_loss(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _nll_check(op, args, kwargs, dev, args[0], args[1], (_arg(args, kwargs, 2, "weight"),))


def _nll_loss_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    weight, total = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 6, "total_weight")
    return _nll_check(op, args, kwargs, dev, args[1], args[2], (args[0], weight, total))


# ---------------------------------------------------------------------------------------------
# pointwise: promotion, in-place castability, strict ops


def _bincount(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    """Counts of integer ids (a MoE router's tokens per expert). CPU measured (torch 2.14), CUDA read
    from aten/src/ATen/native/cuda/SummaryOps.cu (``_bincount_cuda``), the same rule: the ids take any
    integer dtype (AT_DISPATCH_INTEGRAL_TYPES: not bool, never floats); the counts are int64, or with
    weights f32 for f32 weights and f64 for every other dtype (the kernel reads them as double: bf16 or
    f16 weights come back f64)."""
    ids = args[0]
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == BOOL:
        kernel = "bincount_cuda" if dev.kernels == "cuda" else "bincount_cpu"
        return _viol(op, "index", f"\"{kernel}\" not implemented for '{_sc(ids.dtype)}'", args, kwargs, [ids], I64)
    weights = _arg(args, kwargs, 1, "weights")
    if weights is None:
        return I64
    return F32 if weights.dtype == F32 else F64
