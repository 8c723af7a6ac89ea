"""Shared pieces of the contract table: the Violation value, dtype wordings, promotion."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from castwise._dtypes import low_dtypes
from castwise.devices import Device


@dataclass(frozen=True)
class Violation:
    """A real kernel would refuse these dtypes.

    Kinds:
    - ``mismatch``: operands that must share a dtype do not (matmul, conv, fused layers, qkv), or
      an in-place result cannot be cast into its destination.
    - ``unsupported``: no kernel for this dtype on this device (flash attention in f32 on CUDA,
      half_to_float softmax on CPU, float8 promotion, bf16/f16 linalg, cdist, FFT, ctc_loss),
      or no kernel on the device at all. ``expected`` is a dtype the kernel has, when one is.
    - ``mask``: a mask or attention bias of the wrong dtype; ``expected`` is the query's dtype for
      attention masks/biases and "bool" for masked_fill / masked_scatter / where conditions.
    - ``strict``: an op that does not promote (lerp) got differing dtypes.
    - ``norm``: normalization parameters (and running stats) against the input, including
      CPU's mixed-dtype rule.
    - ``index``: an index tensor that is not integral (``expected`` "int64"), or a source/values
      tensor whose dtype differs from the destination (index_put, scatter, index_copy, ...).
    """

    op: str  # "aten.addmm"
    kind: str  # "mismatch" | "unsupported" | "mask" | "strict" | "norm" | "index"
    message: str  # worded like the real kernel's error on that device where known
    culprits: tuple[int, ...]  # indices into tensor_args(args, kwargs) of the operands at fault
    expected: str | None  # canonical dtype name the kernel wanted for the culprits, if one


Args = tuple[Any, ...]
Kwargs = dict[str, Any]

# A rule returns a Violation (the kernel refuses), the result dtype (it accepts), or None
# (it accepts and the result is not modelled, e.g. an op that returns no tensor).
Rule = Callable[[str, Args, Kwargs, Device], Any]

Tensor = torch.Tensor
F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
I64, I32, U8, BOOL = torch.int64, torch.int32, torch.uint8, torch.bool
_REDUCED = low_dtypes()
# the running torch release (major, minor): rules follow its own kernels where releases differ
TORCH_RELEASE: tuple[int, ...] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
# before 2.12 (measured on 2.10.0 and 2.11.0: tests/trace/truth/torch-2.1{0,1}-*): CPU's mv/addmv cast
# self to the matrix's dtype and check matrix against vector by scalar type, mse_loss_backward
# runs one TensorIterator over its operands (no promotion), and nll_loss reads its target as Long;
# 2.12 checks addmv's three dtypes alike, returns mse_loss_backward in the input's dtype and
# words the target check "Long or Byte"
CPU_CHECKS_BEFORE_2_12: bool = TORCH_RELEASE < (2, 12)
_INDEX_TYPES = (I64, I32)


def tensor_args(args: Args, kwargs: Kwargs) -> list[Tensor]:
    """The flat list of tensor arguments that ``Violation.culprits`` index into."""
    return [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


# ---------------------------------------------------------------------------------------------
# dtype spellings as the kernels print them

_SCALAR = {  # c10::ScalarType names ("expected scalar type Float but found BFloat16")
    F32: "Float",
    F64: "Double",
    BF16: "BFloat16",
    F16: "Half",
    I64: "Long",
    I32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    U8: "Byte",
    BOOL: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}
_CPP = {  # C++ type names (caffe2::TypeMeta printing: "float != c10::BFloat16")
    F32: "float",
    F64: "double",
    BF16: "c10::BFloat16",
    F16: "c10::Half",
    I64: "long int",
    I32: "int",
    torch.int16: "short int",
    torch.int8: "signed char",
    U8: "unsigned char",
    BOOL: "bool",
}
_LEGACY = {  # legacy tensor type names ("torch.FloatTensor"); bf16 never had one
    F32: "FloatTensor",
    F64: "DoubleTensor",
    F16: "HalfTensor",
    I64: "LongTensor",
    I32: "IntTensor",
    torch.int16: "ShortTensor",
    torch.int8: "CharTensor",
    U8: "ByteTensor",
    BOOL: "BoolTensor",
}


def _sc(dtype: torch.dtype) -> str:
    return _SCALAR.get(dtype, str(dtype).removeprefix("torch."))


def _cpp(dtype: torch.dtype) -> str:
    return _CPP.get(dtype, str(dtype).removeprefix("torch."))


def _legacy(dtype: torch.dtype, dev: Device) -> str:
    """``Tensor.toString()``: "torch.FloatTensor", "torch.cuda.HalfTensor", "CPUBFloat16Type"."""
    name = _LEGACY.get(dtype)
    if name is None:
        return f"{dev.label}{_sc(dtype)}Type"
    return dev.legacy_type(name)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# helpers


def _arg(args: Args, kwargs: Kwargs, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _viol(
    op: str,
    kind: str,
    message: str,
    args: Args,
    kwargs: Kwargs,
    culprits: Iterable[Tensor | None],
    expected: torch.dtype | None,
) -> Violation:
    flat = tensor_args(args, kwargs)
    idx: set[int] = set()
    for c in culprits:
        if c is None:
            continue
        idx.update(i for i, t in enumerate(flat) if t is c)  # a tensor passed twice is at fault twice
    return Violation(op, kind, message, tuple(sorted(idx)), None if expected is None else _name(expected))


def _scalar(op: str, kind: str, args: Args, kwargs: Kwargs, want: torch.dtype, bad: Sequence[Tensor]) -> Violation:
    """A kernel's typed read refuses ``bad`` (the first one named): "expected scalar type Float but
    found BFloat16"; ``want`` is the dtype it read them as."""
    return _viol(op, kind, f"expected scalar type {_sc(want)} but found {_sc(bad[0].dtype)}", args, kwargs, bad, want)


def _odd(tensors: Sequence[Tensor | None], prefer: Tensor) -> tuple[list[Tensor], torch.dtype]:
    """The operands whose dtype differs from the reference dtype, and that dtype. The reference
    is the dtype most operands share; ties go to ``prefer`` (the weight-like operand)."""
    present = [t for t in tensors if t is not None]
    counts: dict[torch.dtype, int] = {}
    for t in present:
        counts[t.dtype] = counts.get(t.dtype, 0) + 1
    best = max(counts.values())
    ref = prefer.dtype if counts.get(prefer.dtype) == best else next(d for d, n in counts.items() if n == best)
    return [t for t in present if t.dtype != ref], ref


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


class _NoPromotion(Exception):
    """torch.promote_types refuses the pair (float8 with anything else): so does every kernel."""

    def __init__(self, message: str, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
        super().__init__(message)
        self.dtypes = dtypes


_PROMOTED: dict[tuple[torch.dtype, torch.dtype], torch.dtype] = {}


def _promote(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    if a is None:
        return b
    if b is None or a == b:
        return a
    # cached: inside an audit torch.promote_types is an op the fake mode dispatches in Python
    found = _PROMOTED.get((a, b))
    if found is not None:
        return found
    try:
        found = _PROMOTED[(a, b)] = torch.promote_types(a, b)
    except RuntimeError as e:
        raise _NoPromotion(str(e), (a, b)) from None
    return found


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    # c10 combine_categories (aten/src/ATen/native/TypeProperties.cpp): a lower-priority operand
    # only counts when it is of a higher category (e.g. a 0-dim float tensor with an int tensor).
    if higher is None:
        return lower
    if lower is None:
        return higher
    if higher.is_complex:
        return higher
    if lower.is_complex:
        return _promote(higher, lower)
    if higher.is_floating_point:
        return higher
    if higher == BOOL or lower.is_floating_point:
        return _promote(higher, lower)
    return higher


def result_type(operands: Iterable[Any]) -> torch.dtype | None:
    """TensorIterator's common dtype: tensors with dims, then 0-dim tensors, then Python numbers
    (a Python float counts as the default dtype)."""
    dim: torch.dtype | None = None
    zero: torch.dtype | None = None
    wrapped: torch.dtype | None = None
    for o in operands:
        if isinstance(o, torch.Tensor):
            if o.dim() > 0:
                dim = _promote(dim, o.dtype)
            else:
                zero = _promote(zero, o.dtype)
        elif isinstance(o, bool):
            wrapped = _promote(wrapped, BOOL)
        elif isinstance(o, int):
            wrapped = _promote(wrapped, I64)
        elif isinstance(o, float):
            wrapped = _promote(wrapped, torch.get_default_dtype())
        elif isinstance(o, complex):
            wrapped = _promote(wrapped, torch.complex64 if torch.get_default_dtype() != F64 else torch.complex128)
    return _combine(dim, _combine(zero, wrapped))


def _can_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    # c10::canCast: no float -> integral, no complex -> non-complex, no non-bool -> bool
    if src.is_complex and not dst.is_complex:
        return False
    if src.is_floating_point and not (dst.is_floating_point or dst.is_complex):
        return False
    return not (src != BOOL and dst == BOOL)


# ---------------------------------------------------------------------------------------------
# matmul family
#
# CPU messages measured. CUDA: addmm/addbmm/linear share the structured meta ADDMM_META in
# LinearAlgebra.cpp (self vs mat2, then mat1 vs mat2) on both devices; mm on CUDA goes through
# addmm_out_cuda_impl in cuda/Blas.cpp ("expected mat1 and mat2 to have the same dtype");
# bmm/baddbmm on CUDA read batch2 with data_ptr<scalar_t> of batch1's type (cuda/Blas.cpp).


def _not_on_device(
    op: str, args: Args, kwargs: Kwargs, dev: Device, devices: tuple[str, ...], overload: str = ""
) -> Violation | None:
    """No kernel for ``dev`` at all; ``overload`` ("aten.histogram.bin_ct") when the dispatcher's
    message names the overload, not the packet."""
    if dev.kernels in devices:
        return None
    name = (overload or op).removeprefix("aten.")
    return _viol(
        op,
        "unsupported",
        f"Could not run 'aten::{name}' with arguments from the '{dev.label}' backend.",
        args,
        kwargs,
        [],
        None,
    )
