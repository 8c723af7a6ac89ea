"""Contracts for matrix products and convolutions."""

from __future__ import annotations

from typing import Any

from castwise.devices import Device
from castwise.trace.contracts._base import (
    BF16,
    BOOL,
    CPU_CHECKS_BEFORE_2_12,
    F16,
    F32,
    Args,
    Kwargs,
    Tensor,
    Violation,
    _arg,
    _cpp,
    _legacy,
    _name,
    _odd,
    _sc,
    _scalar,
    _viol,
)


def _mm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    a, b = args[0], args[1]
    if a.dtype == b.dtype:
        # CUDA (measured, H100): cuBLAS has no integer GEMM, so every non-float mm is refused
        if a.dtype == BOOL or (dev.kernels == "cuda" and not (a.dtype.is_floating_point or a.dtype.is_complex)):
            kernel = "addmm_cuda" if dev.kernels == "cuda" else "addmm_impl_cpu_"
            return _viol(
                op, "unsupported", f"\"{kernel}\" not implemented for '{_sc(a.dtype)}'", args, kwargs, [a, b], None
            )
        return a.dtype
    if op == "aten.mm":
        what = "mat1 and mat2" if dev.kernels == "cuda" else "m1 and m2"
        msg = f"expected {what} to have the same dtype, but got: {_cpp(a.dtype)} != {_cpp(b.dtype)}"
    elif op in ("aten.dot", "aten.vdot"):
        msg = f"dot : expected both vectors to have same dtype, but found {_sc(a.dtype)} and {_sc(b.dtype)}"
    elif op == "aten.mv" and (dev.kernels == "cuda" or CPU_CHECKS_BEFORE_2_12):
        msg = f"expected scalar type {_sc(a.dtype)} but found {_sc(b.dtype)}"  # measured, H100
    elif op == "aten.mv":
        msg = (
            f"addmv input tensors must have the same dtype, but got {_sc(b.dtype)}, {_sc(a.dtype)}, and {_sc(b.dtype)}"
        )
    else:  # bmm, matmul
        msg = f"expected scalar type {_sc(a.dtype)} but found {_sc(b.dtype)}"
    return _viol(op, "mismatch", msg, args, kwargs, [a], b.dtype)


def _addmm_like(op: str, args: Args, kwargs: Kwargs, dev: Device, bias: Tensor | None, m1: Tensor, m2: Tensor) -> Any:
    if bias is None:
        return _mm("aten.mm", (m1, m2), {}, dev) if m1.dtype != m2.dtype else m1.dtype
    if bias.dtype != m2.dtype:
        msg = f"self and mat2 must have the same dtype, but got {_sc(bias.dtype)} and {_sc(m2.dtype)}"
    elif m1.dtype != m2.dtype:
        msg = f"mat1 and mat2 must have the same dtype, but got {_sc(m1.dtype)} and {_sc(m2.dtype)}"
    else:
        return m2.dtype
    culprits, ref = _odd([bias, m1, m2], prefer=m2)
    return _viol(op, "mismatch", msg, args, kwargs, culprits, ref)


def _addmm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _addmm_like(op, args, kwargs, dev, args[0], args[1], args[2])


def _linear(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    x, w = args[0], args[1]
    b = _arg(args, kwargs, 2, "bias")
    out = _addmm_like(op, args, kwargs, dev, b, x, w)
    if isinstance(out, Violation) and b is None:
        # linear without bias is mm(x, w.t()): the mm message, with x at fault
        msg = _mm("aten.mm", (x, w), {}, dev)
        return _viol(op, "mismatch", msg.message, args, kwargs, [x], w.dtype)
    return out


def _baddbmm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, b1, b2 = args[0], args[1], args[2]
    if s.dtype != b1.dtype:
        msg = (
            f"Input dtypes must be the same, got: input {_cpp(s.dtype)}, batch1: {_cpp(b1.dtype)}, "
            f"batch2: {_cpp(b2.dtype)}"
        )
    elif b1.dtype != b2.dtype:
        msg = f"expected scalar type {_sc(b1.dtype)} but found {_sc(b2.dtype)}"
    else:
        return s.dtype
    culprits, ref = _odd([s, b1, b2], prefer=b2)
    return _viol(op, "mismatch", msg, args, kwargs, culprits, ref)


def _addmv(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, m, v = args[0], args[1], args[2]
    if s.dtype == m.dtype == v.dtype:
        return s.dtype
    cast_self = dev.kernels == "cuda" or CPU_CHECKS_BEFORE_2_12
    if cast_self and m.dtype == v.dtype:
        return m.dtype  # CUDA (measured, H100): self is cast to the matrix's dtype, not checked
    culprits, ref = _odd([s, m, v], prefer=m)
    if cast_self:
        return _scalar(op, "mismatch", args, kwargs, m.dtype, [v])
    return _viol(
        op,
        "mismatch",
        f"addmv input tensors must have the same dtype, but got {_sc(s.dtype)}, {_sc(m.dtype)}, and {_sc(v.dtype)}",
        args,
        kwargs,
        culprits,
        ref,
    )


# ---------------------------------------------------------------------------------------------
# convolution
#
# The kernel path decides (Device.path, from the device's capabilities): torch sends a bf16 (f16)
# convolution to oneDNN only where its oneDNN build takes bf16 (f16) on this CPU
# (ConvUtils use_mkldnn: mkldnn_bf16_device_check, AVX-512 cores; f16 needs AVX512-FP16/AMX-FP16).
# - cpu.onednn (measured on AVX-512): weight and bias must share the input's type, worded with the
#   legacy type names; the backward also takes an f32 weight.
# - cpu.native (measured on AVX2, and for f32/f16 on AVX-512): the weight must have the input's
#   dtype ("expected scalar type ..."), any float bias is added; the backward wants one dtype.
# - CUDA: Convolution.cpp check_input_same_type_as_parameters (cudnn/miopen backends): input,
#   weight and bias must all share the input's type.


def _conv_check(op: str, args: Args, kwargs: Kwargs, dev: Device, x: Tensor, w: Tensor, b: Tensor | None) -> Any:
    path = dev.path(_name(x.dtype))
    if path != "cpu.native":
        tail = " or input should be a MKLDNN tensor and {0} is a dense tensor" if path == "cpu.onednn" else ""
        for name, p in (("weight", w), ("bias", b)):
            if p is not None and p.dtype != x.dtype:
                # a weight of another type: the odd one out is at fault; a bias: the bias
                culprits, ref = _odd([x, w, b], prefer=w) if name == "weight" else ([b], x.dtype)
                msg = (
                    f"Input type ({_legacy(x.dtype, dev)}) and {name} type ({_legacy(p.dtype, dev)}) should be the same"
                )
                return _viol(op, "mismatch", msg + tail.format(name), args, kwargs, culprits, ref)
        return x.dtype
    if w.dtype != x.dtype:
        culprits, ref = _odd([x, w], prefer=w)
        return _viol(
            op, "mismatch", f"expected scalar type {_sc(x.dtype)} but found {_sc(w.dtype)}", args, kwargs, culprits, ref
        )
    return x.dtype


def _conv(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _conv_check(op, args, kwargs, dev, args[0], args[1], _arg(args, kwargs, 2, "bias"))


def _conv_nobias(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:  # cudnn_convolution(self, weight, ...)
    return _conv_check(op, args, kwargs, dev, args[0], args[1], None)


def _conv_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    go, x, w = args[0], args[1], args[2]
    mask = _arg(args, kwargs, 10, "output_mask", [True, True, True])
    if go.dtype != x.dtype:
        return _scalar(op, "mismatch", args, kwargs, x.dtype, [go])
    # oneDNN's backward also takes an f32 weight (measured for bf16), and the other 16-bit type
    # where it takes both (AMX, measured); native and cuDNN want one type
    onednn = dev.path(_name(x.dtype)) == "cpu.onednn"
    reordered = (F32, BF16, F16) if dev.onednn_both_halves() else (F32,)
    if w.dtype != x.dtype and not (onednn and w.dtype in reordered):
        return _scalar(op, "mismatch", args, kwargs, x.dtype, [w])
    return x.dtype if mask[0] else w.dtype


# ---------------------------------------------------------------------------------------------
# normalization
#
# CPU (measured; aten/src/ATen/native/cpu/mixed_data_type.h): if the first defined parameter
# has the input's dtype, every parameter must have it ("expected scalar type X but found Y");
# otherwise it is "mixed": allowed only for a bf16/f16 input with every parameter f32, else
# "mixed dtype (CPU): expect parameter to have scalar type of Float".
# CUDA: layer_norm (cuda/layer_norm_kernel.cu: gamma/beta read as data_ptr<T> of X's type) and
# group_norm (cuda/group_norm_kernel.cu: gamma.const_data_ptr<T>(), after group_norm.cpp's
# device-agnostic mixed check) want every parameter in the input's dtype. batch_norm
# (cuda/Normalization.cu is_mixed_type: parameters read as acc type) keeps the mixed rule.
