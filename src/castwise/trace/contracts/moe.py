"""Contracts for mixture-of-experts ops: grouped matrix products and expert histograms.

``aten._grouped_mm`` (what transformers' default ``grouped_mm`` experts call, Mixtral, Qwen3-MoE,
DeepSeek-V3...): CPU measured (torch 2.14); CUDA read from aten/src/ATen/native/GroupedMMUtils.h
(``_grouped_mm_validate_inputs``, ``_resolve_grouped_mm_out_dtype``, ``_grouped_mm_fallback``)
and native/cuda/GroupedBlas.cpp (``_grouped_mm_cuda``). Both devices validate the same way: each
operand f32, bf16 or f16; the result in ``mat_a``'s dtype. bf16 x bf16 takes CUTLASS's fast path
on sm90+; every other pair takes the fallback, one ``mm_out`` per group, which refuses operands
of two dtypes with mm's own message. Torch's meta kernel (what fake tensors run) is stricter than
both real kernels: it refuses f32 (and f16 without cuBLASLt), so castwise runs this op on its
own fake implementation (trace/fastpath.py) and this rule decides.
"""

from __future__ import annotations

from typing import Any

from castwise.devices import Device
from castwise.trace.contracts._base import (
    BF16,
    BOOL,
    F16,
    F32,
    TORCH_RELEASE,
    Args,
    Kwargs,
    _arg,
    _cpp,
    _sc,
    _viol,
)
from castwise.trace.contracts.matmul import _mm

_GROUPED = (F32, BF16, F16)


def _grouped_mm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    a, b = args[0], args[1]
    for name, m in (("mat_a", a), ("mat_b", b)):
        if m.dtype not in _GROUPED:
            return _viol(
                op,
                "unsupported",
                f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {_sc(m.dtype)}",
                args,
                kwargs,
                [m],
                BF16,
            )
    out_dtype = _arg(args, kwargs, 4, "out_dtype")
    if out_dtype is not None and out_dtype != a.dtype:
        return _viol(
            op, "unsupported", "Grouped gemm output dtype must match `mat_a` dtype", args, kwargs, [a], out_dtype
        )
    if a.dtype != b.dtype:
        # the activation is at fault (the experts' weights are what the model was built with).
        # torch >= 2.15 validates the pair up front (measured on CPU; GroupedMMUtils.h, shared by
        # CUDA); before, the fallback's per-group mm_out (bmm_out for 3d x 3d) refused it in mm's words
        if TORCH_RELEASE >= (2, 15):
            msg = f"Expected mat_a and mat_b to have the same dtype, got {_sc(a.dtype)} and {_sc(b.dtype)}"
        elif a.dim() == 3 and b.dim() == 3:  # one bmm_out, whose structured out check (all devices) words it
            msg = f"Expected out tensor to have dtype {_cpp(b.dtype)}, but got {_cpp(a.dtype)} instead"
        else:
            msg = _mm("aten.mm", (a, b), {}, dev).message
        return _viol(op, "mismatch", msg, args, kwargs, [a], b.dtype)
    return a.dtype


def _histc(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    """Bin counts in the input's dtype. CPU has floating kernels only (measured: int32, int64 and
    uint8 raise); CUDA's also take integers (transformers' MoE routing passes int32 there)."""
    x = args[0]
    if dev.kernels == "cuda" and x.dtype in (BF16, F16):
        # CUDA (measured, H100, torch 2.11): no reduced-precision histc kernel
        msg = "HalfTensor is not supported" if x.dtype == F16 else "\"histc\" not implemented for 'BFloat16'"
        return _viol(op, "unsupported", msg, args, kwargs, [x], F32)
    if x.is_floating_point() or (dev.kernels == "cuda" and x.dtype != BOOL):
        return x.dtype
    if dev.kernels == "cuda":  # bool (measured, H100)
        return _viol(op, "unsupported", "\"histc\" not implemented for 'Bool'", args, kwargs, [x], F32)
    kernel = "linspace_cpu" if x.dtype == BOOL else "histogram_cpu"  # bool fails making the bin edges
    return _viol(op, "unsupported", f"\"{kernel}\" not implemented for '{_sc(x.dtype)}'", args, kwargs, [x], F32)


def _bitwise_not(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    """Integers and bool only (DeepSeek-V3's router masks expert groups with ``~mask``)."""
    x = args[0]
    if not x.is_floating_point() and not x.is_complex():
        return x.dtype
    kernel = "bitwise_not_cuda" if dev.kernels == "cuda" else "bitwise_not_cpu"
    return _viol(op, "unsupported", f"\"{kernel}\" not implemented for '{_sc(x.dtype)}'", args, kwargs, [x], BOOL)
