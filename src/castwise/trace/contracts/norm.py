"""Contracts for normalisation layers (layer, group, batch, RMS norm), forward and backward."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from castwise.devices import Device
from castwise.trace.contracts._base import _REDUCED, F32, Args, Kwargs, Tensor, Violation, _arg, _sc, _scalar, _viol


def _norm_params(
    op: str,
    args: Args,
    kwargs: Kwargs,
    dev: Device,
    x: Tensor,
    params: Sequence[Tensor | None],
    cuda_mixed: bool,
    kernel_message: bool = False,
    shared_mixed_check: bool = False,
) -> Violation | None:
    defined = [p for p in params if p is not None]
    if not defined:
        return None
    if kernel_message:
        # layer/group norm backward: no up-front mixed check, the kernel's typed read of the
        # weight fails instead (CPU measured; the same acceptance rule as the forward)
        v = _norm_params(op, args, kwargs, dev, x, params, cuda_mixed)
        if v is None:
            return None
        found = next(p for p in defined if p.dtype != x.dtype)
        return Violation(
            v.op, v.kind, f"expected scalar type {_sc(x.dtype)} but found {_sc(found.dtype)}", v.culprits, v.expected
        )
    mixed = defined[0].dtype != x.dtype
    if dev.kernels == "cuda" and not cuda_mixed:
        bad = [p for p in defined if p.dtype != x.dtype]
        if not bad:
            return None
        if shared_mixed_check and mixed and not (x.dtype in _REDUCED and all(p.dtype == F32 for p in defined)):
            msg = "mixed dtype (CPU): expect parameter to have scalar type of Float"  # group_norm.cpp, all devices
        else:
            msg = f"expected scalar type {_sc(x.dtype)} but found {_sc(bad[0].dtype)}"
        return _viol(op, "norm", msg, args, kwargs, bad, x.dtype)
    if not mixed:
        bad = [p for p in defined if p.dtype != x.dtype]
        return _scalar(op, "norm", args, kwargs, x.dtype, bad) if bad else None
    if x.dtype in _REDUCED:
        bad = [p for p in defined if p.dtype != F32]
        if not bad:
            return None
        expected = F32
    else:
        bad = [p for p in defined if p.dtype != x.dtype]
        expected = x.dtype
    msg = (
        "mixed dtype (CPU): expect parameter to have scalar type of Float"
        if dev.kernels == "cpu"
        else f"expected scalar type Float but found {_sc(bad[0].dtype)}"
    )
    return _viol(op, "norm", msg, args, kwargs, bad, expected)


def _layer_group_norm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # (native_)layer_norm(input, normalized_shape, weight, bias, ...), group_norm(input, num_groups,
    # weight, bias, ...), native_group_norm(input, weight, bias, ...)
    x, group = args[0], "group_norm" in op
    at = 1 if op == "aten.native_group_norm" else 2
    params = [_arg(args, kwargs, at, "weight"), _arg(args, kwargs, at + 1, "bias")]
    return _norm_params(op, args, kwargs, dev, x, params, cuda_mixed=False, shared_mixed_check=group) or x.dtype


def _batch_norm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # native_batch_norm / _native_batch_norm_legit(_no_training) / _batch_norm_with_update /
    # cudnn_batch_norm: (input, weight, bias, running_mean, running_var, ...); .no_stats has no
    # running stats (args[3] is the `training` bool).
    x = args[0]
    params = [_arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")]
    if dev.kernels == "cuda":
        # CUDA (measured, H100): the running statistics are read in any float dtype; only the
        # affine parameters must be x's dtype or float32
        return _batch_norm_cuda_params(op, args, kwargs, dev, x, (("weight", params[0]), ("bias", params[1])))
    v = _norm_params(op, args, kwargs, dev, x, params + _running_stats(args, kwargs), cuda_mixed=True)
    return v or x.dtype


def _running_stats(args: Args, kwargs: Kwargs) -> list[Tensor | None]:
    # batch norm's running_mean, running_var at 3 and 4, where given (.no_stats has a bool at 3)
    stats = (_arg(args, kwargs, 3, "running_mean"), _arg(args, kwargs, 4, "running_var"))
    return [s for s in stats if isinstance(s, torch.Tensor)]


def _batch_norm_cuda_stats(args: Args, kwargs: Kwargs, x: Tensor, weight: Tensor | None) -> tuple[str, Tensor] | None:
    """The training backward of a spatial 16-bit input: the running statistics must be in the
    parameters' dtype, x's or f32 (measured, H100 and H200, torch 2.11: a bf16 BatchNorm2d whose
    buffers stayed f32, as DeepSpeed's and FSDP2's casts leave them, runs forward and is refused
    in backward; so are 16-bit stats under the mixed path's f32 parameters; an (N, C) input runs)."""
    if weight is None or weight.dtype not in (x.dtype, F32) or x.dtype not in _REDUCED or x.dim() < 3:
        return None
    if _arg(args, kwargs, 7, "train") is not True:
        return None
    for i, name in ((3, "running_mean"), (4, "running_var")):
        stat = _arg(args, kwargs, i, name)
        if isinstance(stat, torch.Tensor) and stat.dtype != weight.dtype:
            return f"Expected {name} to have type {_sc(weight.dtype)} but got {_sc(stat.dtype)}", stat
    return None


def _batch_norm_cuda_params(
    op: str, args: Args, kwargs: Kwargs, dev: Device, x: Tensor, named: Sequence[tuple[str, Tensor | None]]
) -> Any:
    """cuda/Normalization.cu's check, in its own words ("Expected weight to have type Float ...")."""
    v = _norm_params(op, args, kwargs, dev, x, [t for _, t in named], cuda_mixed=True)
    if v is None:
        return x.dtype
    defined = [(n, t) for n, t in named if t is not None]
    want = F32 if defined[0][1].dtype != x.dtype and x.dtype in _REDUCED else x.dtype
    name, bad = next(((n, t) for n, t in defined if t.dtype != want), defined[0])
    msg = f"Expected {name} to have type {_sc(want)} but got {_sc(bad.dtype)}"
    return _viol(op, "norm", msg, args, kwargs, [t for _, t in defined if t.dtype != want], want)


def _layer_norm_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    go, x = args[0], args[1]
    w, b = _arg(args, kwargs, 5, "weight"), _arg(args, kwargs, 6, "bias")
    if go.dtype != x.dtype:
        return _scalar(op, "mismatch", args, kwargs, x.dtype, [go])
    return _norm_params(op, args, kwargs, dev, x, [w, b], cuda_mixed=False, kernel_message=True) or x.dtype


def _group_norm_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    go, x = args[0], args[1]
    if go.dtype != x.dtype:  # group_norm.cpp, all devices
        return _viol(op, "mismatch", "Expected scalar types of X and dY are same.", args, kwargs, [go], x.dtype)
    w = _arg(args, kwargs, 4, "weight")
    return _norm_params(op, args, kwargs, dev, x, [w], cuda_mixed=False, kernel_message=True) or x.dtype


def _batch_norm_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # the parameters' mixed check runs before grad_out is read (CPU measured); CUDA checks
    # grad_output first (measured, H100)
    go, x = args[0], args[1]
    if dev.kernels == "cuda":
        if go.dtype != x.dtype:
            msg = f"Expected grad_output to have type {_sc(x.dtype)} but got {_sc(go.dtype)}"
            return _viol(op, "mismatch", msg, args, kwargs, [go], x.dtype)
        w = _arg(args, kwargs, 2, "weight")
        v = _batch_norm_cuda_params(op, args, kwargs, dev, x, (("weight", w),))
        if isinstance(v, Violation):
            if x.dim() < 3 and isinstance(_arg(args, kwargs, 3, "running_mean"), torch.Tensor) and w is not None:
                # the (N, C) kernel with running stats words it so (measured, H200)
                v = dataclasses.replace(v, message=f"expected scalar type Float but found {_sc(w.dtype)}")
            return v
        stats = _batch_norm_cuda_stats(args, kwargs, x, w)
        return v if stats is None else _viol(op, "norm", stats[0], args, kwargs, [stats[1]], x.dtype)
    v = _norm_params(
        op, args, kwargs, dev, x, [_arg(args, kwargs, 2, "weight"), *_running_stats(args, kwargs)], cuda_mixed=True
    )
    if v:
        return v
    return _scalar(op, "mismatch", args, kwargs, x.dtype, [go]) if go.dtype != x.dtype else x.dtype


def _rms_norm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # CPU measured: any weight dtype (layer_norm.cpp falls back from the fused kernel to the
    # composite when input and weight differ; the result is cast back to the input's dtype).
    x = args[0]
    w = _arg(args, kwargs, 2, "weight")
    if op == "aten._fused_rms_norm" and dev.kernels == "cuda" and w is not None and w.dtype != x.dtype:
        # called directly, the CUDA fused kernel reads weight as data_ptr<T> of the input's type
        # (cuda/layer_norm_kernel.cu); the composite rms_norm never calls it with a mismatch
        return _scalar(op, "norm", args, kwargs, x.dtype, [w])
    return x.dtype


# ---------------------------------------------------------------------------------------------
# attention
#
# scaled_dot_product_attention: validate_sdpa_input (transformers/attention.cpp, all devices):
# q, k, v share a dtype; attn_mask is bool, float32, or q's dtype. CPU backends measured. CUDA
# kernels: flash (transformers/cuda/flash_attn/flash_api.cpp) takes only f16/bf16;
# memory-efficient (transformers/cuda/attention.cu) takes f32/f16/bf16 with an attn_bias in q's
# dtype; cudnn (transformers/cuda/attention.cu, cudnn MHA) takes only f16/bf16.
