"""Contracts for elementwise, in-place, copy, factory and reduction ops."""

from __future__ import annotations

from typing import Any

import torch

from castwise.devices import Device
from castwise.trace.contracts._base import (
    BF16,
    BOOL,
    F16,
    F32,
    I64,
    Args,
    Kwargs,
    _arg,
    _can_cast,
    _cpp,
    _promote,
    _sc,
    _viol,
    result_type,
)


def _promoting(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return result_type([*args, *kwargs.values()])


def _gelu_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    """Promotes like any activation backward, except on oneDNN's path (a bf16/f16 input on a CPU
    whose oneDNN takes that dtype), which reorders the grad into the input's type and has no
    f16 <-> bf16 reorder (measured on AVX-512 for a bf16 input; f16 read from the same code). A CPU
    whose oneDNN takes both halves (AMX) promotes the mix, as measured."""
    grad, x = args[0], args[1]
    crossed = {grad.dtype, x.dtype} == {BF16, F16}
    onednn = dev.path(str(x.dtype).removeprefix("torch.")) == "cpu.onednn"
    if crossed and onednn and not dev.onednn_both_halves():
        return _viol(
            op,
            "unsupported",
            "could not create a primitive descriptor for the reorder primitive.",
            args,
            kwargs,
            [grad],
            x.dtype,
        )
    return result_type(args[:2])


def _true_divide(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    if kwargs.get("rounding_mode") is not None or (len(args) > 2 and isinstance(args[2], str)):
        return result_type(args[:2])
    common = result_type(args[:2])
    return common if common is None or common.is_floating_point or common.is_complex else torch.get_default_dtype()


def _comparison(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return BOOL


def _cat(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    tensors = [t for t in args[0] if isinstance(t, torch.Tensor)]
    out: torch.dtype | None = None
    for t in tensors:  # cat promotes over every input, whatever its shape
        out = _promote(out, t.dtype)
    return out


def _inplace(op: str, args: Args, kwargs: Kwargs, dev: Device, divide: bool = False) -> Any:
    s = args[0]
    others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, (torch.Tensor, bool, int, float, complex))]
    common = result_type([s, *others])
    if common is None:
        return s.dtype
    if divide and not (common.is_floating_point or common.is_complex):
        common = torch.get_default_dtype()
    if not _can_cast(common, s.dtype):
        msg = f"result type {_sc(common)} can't be cast to the desired output type {_sc(s.dtype)}"
        culprits = [a for a in others if isinstance(a, torch.Tensor) and not _can_cast(a.dtype, s.dtype)]
        if culprits:
            return _viol(op, "mismatch", msg, args, kwargs, culprits, s.dtype)
        # nothing else is at fault (an integer true division, a float Python scalar): the
        # destination needs the computed dtype
        return _viol(op, "mismatch", msg, args, kwargs, [s], common)
    return s.dtype


def _inplace_div(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    rounding = kwargs.get("rounding_mode") or (args[2] if len(args) > 2 and isinstance(args[2], str) else None)
    return _inplace(op, args[:2], {}, dev, divide=rounding is None)


def _lerp(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # lerp does not promote (Lerp.cpp meta): end must have self's dtype; a weight tensor with
    # dims too (a 0-dim weight is exempt, measured)
    s, end = args[0], args[1]
    weight = _arg(args, kwargs, 2, "weight")
    for name, t in (("end", end), ("weight", weight)):
        if isinstance(t, torch.Tensor) and (name == "end" or t.dim() > 0) and t.dtype != s.dtype:
            msg = f"expected dtype {_cpp(s.dtype)} for `{name}` but got dtype {_cpp(t.dtype)}"
            return _viol(op, "strict", msg, args, kwargs, [t], s.dtype)
    return s.dtype


def _copy(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return args[0].dtype  # copy_ casts whatever it gets


def _same_as_self(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return first.dtype if isinstance(first, torch.Tensor) else None


def _float_unary(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # sqrt, exp, sigmoid, ...: integral/bool inputs compute in the default dtype
    x = args[0]
    return x.dtype if (x.dtype.is_floating_point or x.dtype.is_complex) else torch.get_default_dtype()


def _float_only(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # activations (gelu, silu, ...) have float kernels only
    x = args[0]
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        name = op.removeprefix("aten.")
        return _viol(op, "unsupported", f"\"{name}\" not implemented for '{_sc(x.dtype)}'", args, kwargs, [x], F32)
    return x.dtype


def _to(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    dtype = kwargs.get("dtype")
    if dtype is None:
        for a in args[1:]:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, torch.Tensor):
                dtype = a.dtype
    return dtype if dtype is not None else args[0].dtype


def _like(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # _to_copy, *_like factories, reductions that keep the input's dtype (norm, nanmean): dtype= or self's
    dtype = kwargs.get("dtype")
    return dtype if dtype is not None else args[0].dtype


def _factory(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    dtype = kwargs.get("dtype")
    if dtype is not None:
        return dtype
    if op in ("aten.full", "aten.arange", "aten.scalar_tensor"):
        values = args[1:2] if op == "aten.full" else args[:3]
        if op == "aten.scalar_tensor":
            return torch.get_default_dtype()
        if any(isinstance(v, bool) for v in values) and op == "aten.full":
            return BOOL
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return I64
    if op in ("aten.randint", "aten.randperm"):
        return I64
    return torch.get_default_dtype()


def _reduce_sum(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    dtype = kwargs.get("dtype")
    if dtype is not None:
        return dtype
    x = args[0]
    return x.dtype if (x.dtype.is_floating_point or x.dtype.is_complex) else I64


def _mean(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    dtype = kwargs.get("dtype")
    x = args[0]
    if dtype is None and not (x.dtype.is_floating_point or x.dtype.is_complex):
        return _viol(
            op,
            "unsupported",
            "mean(): could not infer output dtype. Input dtype must be either a floating "
            f"point or complex dtype. Got: {_sc(x.dtype)}",
            args,
            kwargs,
            [x],
            F32,
        )
    return dtype if dtype is not None else x.dtype


def _to_long(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return I64


def _no_tensor(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return None  # returns no tensor (item, sym sizes, ...): nothing to check


# ---------------------------------------------------------------------------------------------
# no kernel for a reduced-precision dtype on the device
#
# These ops dispatch their kernel on the input's dtype with a list that leaves out bf16 and/or
# f16, so a bf16/f16 input raises where the fake kernel (meta function) happily returns a bf16/f16
# result. CPU: measured on torch 2.14 (each rule's bf16, f16 and f32 cases run in
# tests/trace/contract_cases.py). CUDA, from the dispatch macros under aten/src/ATen/native/cuda/:
# - linalg (BatchLinearAlgebra.cpp, BatchLinearAlgebraLib.cpp: the cuSOLVER/MAGMA wrappers
#   dispatch AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES): float/double/complex only. Kernel names
#   read there: geqrf_cuda, orgqr_cuda, cholesky_cuda, cholesky_solve_cuda, lu_cuda,
#   triangular_solve_cuda, linalg_eigh_cuda, linalg_eig_cuda, svd_cuda (MAGMA path); the names
#   for cholesky_inverse and ldl_factor follow the same pattern but were not found.
# - DistanceKernel.cu: AT_DISPATCH_FLOATING_TYPES "cdist_cuda" / "pdist_cuda".
# - LossCTC.cu: AT_DISPATCH_FLOATING_TYPES "ctc_loss_cuda".
# - UnarySpecialOpsKernel.cu: AT_DISPATCH_FLOATING_TYPES "ndtri_cuda"; ZetaKernel.cu "zeta_cuda".
# - CuFFTPlanCache.h: cuFFT takes Half (power-of-two signal sizes only) but not BFloat16
#   ("cuFFT doesn't support tensor of type: BFloat16").
# - histogram.bin_ct and the histogramdd ops have no CUDA kernel at all (CPU/MPS only in
#   native_functions.yaml).
# - binomial: Distributions.cu dispatches with Half and BFloat16, so only CPU refuses it; the
#   CUDA dirichlet and gamma samplers are taken to do the same (not read).
# Device-agnostic checks (linalg.inv / slogdet refuse "Low precision dtypes"; lstsq's default
# rcond asks _get_epsilon, which knows only float and double) stand for both devices.
# Not here: torch.fft.* public functions raise "Unsupported dtype BFloat16" in their composite
# code before any aten op is dispatched, on fake tensors too, so the trace itself fails there; and
# nn.LSTM in f16 on CPU, which reaches oneDNN (mkldnn_rnn_layer) only on CPUs whose oneDNN build
# supports f16 (this machine's does not, and the native path runs f16 fine): whether it fails is
# a property of the CPU and the oneDNN build, not of the dtype, so no rule can be right for both.
