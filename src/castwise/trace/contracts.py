"""The op dtype-contract table: what each real kernel accepts and returns, by target device.

Fake kernels propagate dtypes but do not check them the way real kernels do (a fake
``linear(f32 input, bf16 weight)`` returns f32 where the real CPU and CUDA kernels raise). This
table closes that gap: :func:`check` says whether the real kernel on ``device`` would refuse
the dtypes it gets, worded like the real error, and :func:`result_dtype` says what it returns when
it accepts. Only metadata is read (dtype, shape, layout), never data, so it works on fake and meta
tensors. It is called for every op from a dispatch mode: a lookup is one dict hit on the
OpOverload, then a small function.

Where the rules come from:
- CPU: measured on real CPU kernels (torch 2.14) and pinned by
  tests/trace/test_contracts_differential.py, which runs every rule's cases on real tensors.
- CUDA: read from PyTorch's kernel sources (paths in the comments at each rule, under
  aten/src/ATen/native/). Where CUDA shares the CPU code path (structured meta functions,
  device-agnostic checks) the CPU measurement stands for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from castwise.devices import Device
from castwise.devices import get as get_device

__all__ = ["Violation", "check", "is_covered", "result_dtype", "tensor_args"]


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
_REDUCED = (BF16, F16)
_INDEX_TYPES = (I64, I32)


def tensor_args(args: Args, kwargs: Kwargs) -> list[Tensor]:
    """The flat list of tensor arguments that ``Violation.culprits`` index into."""
    return [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


# ---------------------------------------------------------------------------------------------
# dtype spellings as the kernels print them

_SCALAR = {  # c10::ScalarType names ("expected scalar type Float but found BFloat16")
    F32: "Float", F64: "Double", BF16: "BFloat16", F16: "Half", I64: "Long", I32: "Int",
    torch.int16: "Short", torch.int8: "Char", U8: "Byte", BOOL: "Bool",
    torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}
_CPP = {  # C++ type names (caffe2::TypeMeta printing: "float != c10::BFloat16")
    F32: "float", F64: "double", BF16: "c10::BFloat16", F16: "c10::Half", I64: "long int",
    I32: "int", torch.int16: "short int", torch.int8: "signed char", U8: "unsigned char", BOOL: "bool",
}
_LEGACY = {  # legacy tensor type names ("torch.FloatTensor"); bf16 never had one
    F32: "FloatTensor", F64: "DoubleTensor", F16: "HalfTensor", I64: "LongTensor", I32: "IntTensor",
    torch.int16: "ShortTensor", torch.int8: "CharTensor", U8: "ByteTensor", BOOL: "BoolTensor",
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


def _viol(op: str, kind: str, message: str, args: Args, kwargs: Kwargs, culprits: Iterable[Tensor | None],
          expected: torch.dtype | None) -> Violation:
    flat = tensor_args(args, kwargs)
    idx: set[int] = set()
    for c in culprits:
        if c is None:
            continue
        idx.update(i for i, t in enumerate(flat) if t is c)  # a tensor passed twice is at fault twice
    return Violation(op, kind, message, tuple(sorted(idx)), None if expected is None else _name(expected))


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


def _promote(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    if a is None:
        return b
    if b is None or a == b:
        return a
    try:
        return torch.promote_types(a, b)
    except RuntimeError as e:
        raise _NoPromotion(str(e), (a, b)) from None


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


def _mm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    a, b = args[0], args[1]
    if a.dtype == b.dtype:
        if a.dtype == BOOL:
            kernel = "addmm_cuda" if dev.kernels == "cuda" else "addmm_impl_cpu_"
            return _viol(op, "unsupported", f"\"{kernel}\" not implemented for '{_sc(a.dtype)}'", args, kwargs,
                         [a, b], None)
        return a.dtype
    if op == "aten.mm":
        what = "mat1 and mat2" if dev.kernels == "cuda" else "m1 and m2"
        msg = f"expected {what} to have the same dtype, but got: {_cpp(a.dtype)} != {_cpp(b.dtype)}"
    elif op in ("aten.dot", "aten.vdot"):
        msg = f"dot : expected both vectors to have same dtype, but found {_sc(a.dtype)} and {_sc(b.dtype)}"
    elif op == "aten.mv":
        msg = (f"addmv input tensors must have the same dtype, but got {_sc(b.dtype)}, {_sc(a.dtype)}, "
               f"and {_sc(b.dtype)}")
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
        msg = (f"Input dtypes must be the same, got: input {_cpp(s.dtype)}, batch1: {_cpp(b1.dtype)}, "
               f"batch2: {_cpp(b2.dtype)}")
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
    culprits, ref = _odd([s, m, v], prefer=m)
    return _viol(op, "mismatch", f"addmv input tensors must have the same dtype, but got {_sc(s.dtype)}, "
                 f"{_sc(m.dtype)}, and {_sc(v.dtype)}", args, kwargs, culprits, ref)


# ---------------------------------------------------------------------------------------------
# convolution
#
# CPU measured: a bf16 input goes to oneDNN, which wants weight and bias in bf16; f32/f16 inputs
# go to the native kernels, which want the weight in the input's dtype and add any float bias.
# CUDA: Convolution.cpp check_input_same_type_as_parameters (cudnn/miopen backends): input,
# weight and bias must all share the input's type.


def _conv_check(op: str, args: Args, kwargs: Kwargs, dev: Device, x: Tensor, w: Tensor, b: Tensor | None) -> Any:
    if dev.kernels == "cuda" or x.dtype == BF16:
        tail = "" if dev.kernels == "cuda" else " or input should be a MKLDNN tensor and {0} is a dense tensor"
        if w.dtype != x.dtype:
            culprits, ref = _odd([x, w, b], prefer=w)
            return _viol(op, "mismatch", f"Input type ({_legacy(x.dtype, dev)}) and weight type "
                         f"({_legacy(w.dtype, dev)}) should be the same" + tail.format("weight"), args, kwargs,
                         culprits, ref)
        if b is not None and b.dtype != x.dtype:
            return _viol(op, "mismatch", f"Input type ({_legacy(x.dtype, dev)}) and bias type "
                         f"({_legacy(b.dtype, dev)}) should be the same" + tail.format("bias"), args, kwargs, [b],
                         x.dtype)
        return x.dtype
    if w.dtype != x.dtype:
        culprits, ref = _odd([x, w], prefer=w)
        return _viol(op, "mismatch", f"expected scalar type {_sc(x.dtype)} but found {_sc(w.dtype)}", args, kwargs,
                     culprits, ref)
    return x.dtype


def _conv(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _conv_check(op, args, kwargs, dev, args[0], args[1], _arg(args, kwargs, 2, "bias"))


def _conv_nobias(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:  # cudnn_convolution(self, weight, ...)
    return _conv_check(op, args, kwargs, dev, args[0], args[1], None)


def _conv_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    go, x, w = args[0], args[1], args[2]
    mask = _arg(args, kwargs, 10, "output_mask", [True, True, True])
    if go.dtype != x.dtype:
        return _viol(op, "mismatch", f"expected scalar type {_sc(x.dtype)} but found {_sc(go.dtype)}", args, kwargs,
                     [go], x.dtype)
    # CPU measured: oneDNN's bf16 backward also takes an f32 weight; CUDA (cudnn) wants one type
    if w.dtype != x.dtype and not (dev.kernels == "cpu" and x.dtype == BF16 and w.dtype == F32):
        return _viol(op, "mismatch", f"expected scalar type {_sc(x.dtype)} but found {_sc(w.dtype)}", args, kwargs,
                     [w], x.dtype)
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


def _norm_params(op: str, args: Args, kwargs: Kwargs, dev: Device, x: Tensor, params: Sequence[Tensor | None],
                 cuda_mixed: bool, kernel_message: bool = False, shared_mixed_check: bool = False) -> Violation | None:
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
        return Violation(v.op, v.kind, f"expected scalar type {_sc(x.dtype)} but found {_sc(found.dtype)}",
                         v.culprits, v.expected)
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
        if not bad:
            return None
        return _viol(op, "norm", f"expected scalar type {_sc(x.dtype)} but found {_sc(bad[0].dtype)}", args, kwargs,
                     bad, x.dtype)
    if x.dtype in _REDUCED:
        bad = [p for p in defined if p.dtype != F32]
        if not bad:
            return None
        expected = F32
    else:
        bad = [p for p in defined if p.dtype != x.dtype]
        expected = x.dtype
    msg = ("mixed dtype (CPU): expect parameter to have scalar type of Float" if dev.kernels == "cpu"
           else f"expected scalar type Float but found {_sc(bad[0].dtype)}")
    return _viol(op, "norm", msg, args, kwargs, bad, expected)


def _layer_norm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    x = args[0]
    v = _norm_params(op, args, kwargs, dev, x, [_arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias")],
                     cuda_mixed=False)
    return v or x.dtype


def _group_norm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    x = args[0]
    at = 2 if op == "aten.group_norm" else 1  # group_norm(input, num_groups, weight, bias, ...)
    v = _norm_params(op, args, kwargs, dev, x, [_arg(args, kwargs, at, "weight"), _arg(args, kwargs, at + 1, "bias")],
                     cuda_mixed=False, shared_mixed_check=True)
    return v or x.dtype


def _batch_norm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # native_batch_norm / _native_batch_norm_legit(_no_training) / _batch_norm_with_update /
    # cudnn_batch_norm: (input, weight, bias, running_mean, running_var, ...); .no_stats has no
    # running stats (args[3] is the `training` bool).
    x = args[0]
    params = [_arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")]
    for i, name in ((3, "running_mean"), (4, "running_var")):
        p = _arg(args, kwargs, i, name)
        if isinstance(p, torch.Tensor):
            params.append(p)
    v = _norm_params(op, args, kwargs, dev, x, params, cuda_mixed=True)
    return v or x.dtype


def _layer_norm_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    go, x = args[0], args[1]
    w, b = _arg(args, kwargs, 5, "weight"), _arg(args, kwargs, 6, "bias")
    if go.dtype != x.dtype:
        return _viol(op, "mismatch", f"expected scalar type {_sc(x.dtype)} but found {_sc(go.dtype)}", args, kwargs,
                     [go], x.dtype)
    return _norm_params(op, args, kwargs, dev, x, [w, b], cuda_mixed=False, kernel_message=True) or x.dtype


def _group_norm_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    go, x = args[0], args[1]
    if go.dtype != x.dtype:  # group_norm.cpp, all devices
        return _viol(op, "mismatch", "Expected scalar types of X and dY are same.", args, kwargs, [go], x.dtype)
    w = _arg(args, kwargs, 4, "weight")
    return _norm_params(op, args, kwargs, dev, x, [w], cuda_mixed=False, kernel_message=True) or x.dtype


def _batch_norm_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # the parameters' mixed check runs before grad_out is read (CPU measured)
    go, x = args[0], args[1]
    params = [_arg(args, kwargs, 2, "weight")]
    for i, name in ((3, "running_mean"), (4, "running_var")):
        p = _arg(args, kwargs, i, name)
        if isinstance(p, torch.Tensor):
            params.append(p)
    v = _norm_params(op, args, kwargs, dev, x, params, cuda_mixed=True)
    if v:
        return v
    if go.dtype != x.dtype:
        return _viol(op, "mismatch", f"expected scalar type {_sc(x.dtype)} but found {_sc(go.dtype)}", args, kwargs,
                     [go], x.dtype)
    return x.dtype


def _rms_norm(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # CPU measured: any weight dtype (layer_norm.cpp falls back from the fused kernel to the
    # composite when input and weight differ; the result is cast back to the input's dtype).
    x = args[0]
    w = _arg(args, kwargs, 2, "weight")
    if op == "aten._fused_rms_norm" and dev.kernels == "cuda" and w is not None and w.dtype != x.dtype:
        # called directly, the CUDA fused kernel reads weight as data_ptr<T> of the input's type
        # (cuda/layer_norm_kernel.cu); the composite rms_norm never calls it with a mismatch
        return _viol(op, "norm", f"expected scalar type {_sc(x.dtype)} but found {_sc(w.dtype)}", args, kwargs, [w],
                     x.dtype)
    return x.dtype


# ---------------------------------------------------------------------------------------------
# attention
#
# scaled_dot_product_attention: validate_sdpa_input (transformers/attention.cpp, all devices):
# q, k, v share a dtype; attn_mask is bool, float32, or q's dtype. CPU backends measured. CUDA
# kernels: flash (transformers/cuda/flash_attn/flash_api.cpp) takes only f16/bf16;
# memory-efficient (transformers/cuda/attention.cu) takes f32/f16/bf16 with an attn_bias in q's
# dtype; cudnn (transformers/cuda/attention.cu, cudnn MHA) takes only f16/bf16.


def _qkv(op: str, args: Args, kwargs: Kwargs, dev: Device, msg_style: str) -> Violation | None:
    q, k, v = args[0], args[1], args[2]
    if q.dtype == k.dtype == v.dtype:
        return None
    # v is the reference: it comes straight from a projection, while q and k go through norms and
    # rotary embeddings, which is where an up-cast usually happens (story 4)
    culprits, ref = [t for t in (q, k) if t.dtype != v.dtype], v.dtype
    if msg_style == "composite":
        msg = (f"Expected query, key, and value to have the same dtype, but got query.dtype: {_cpp(q.dtype)} "
               f"key.dtype: {_cpp(k.dtype)} and value.dtype: {_cpp(v.dtype)} instead.")
    elif msg_style == "flash_cuda":
        other = k if k.dtype != q.dtype else v
        msg = f"query and {'key' if other is k else 'value'} must have the same dtype"
    elif msg_style == "efficient_cuda":
        other = "key" if k.dtype != q.dtype else "value"
        msg = f"Expected query.scalar_type() == {other}.scalar_type() to be true, but got false."
    else:
        other_t = k if k.dtype != q.dtype else v
        msg = f"expected scalar type {_sc(q.dtype)} but found {_sc(other_t.dtype)}"
    return _viol(op, "mismatch", msg, args, kwargs, culprits, ref)


def _not_on_device(op: str, args: Args, kwargs: Kwargs, dev: Device, devices: tuple[str, ...]) -> Violation | None:
    if dev.kernels in devices:
        return None
    return _viol(op, "unsupported", f"Could not run 'aten::{op.removeprefix('aten.')}' with arguments from the "
                 f"'{dev.label}' backend.", args, kwargs, [], None)


def _sdpa(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    v = _qkv(op, args, kwargs, dev, "composite")
    if v:
        return v
    mask = _arg(args, kwargs, 3, "attn_mask")
    if mask is not None and mask.dtype not in (BOOL, F32, q.dtype):
        return _viol(op, "mask", f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                     f"attn_mask.dtype: {_cpp(mask.dtype)} and  query.dtype: {_cpp(q.dtype)} instead.", args, kwargs,
                     [mask], q.dtype)
    if (dev.kernels == "cuda" and mask is not None and mask.dtype != BOOL and mask.dtype != q.dtype
            and q.dtype in _REDUCED):
        # On CUDA flash attention takes no mask, so a masked f16/bf16 call goes to the
        # memory-efficient kernel, which wants the bias in q's dtype (transformers/cuda/attention.cu
        # "invalid dtype for bias - should match query's dtype"); the float32 mask that passes
        # validate_sdpa_input fails there. (Math would take it, but is only chosen when the
        # efficient kernel cannot run the shapes at all.)
        return _viol(op, "mask", "invalid dtype for bias - should match query's dtype", args, kwargs, [mask], q.dtype)
    return q.dtype


def _sdpa_math(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # CPU measured: the math kernel upcasts reduced q/k/v to float32 and casts the result back
    # to q's dtype, so mixed dtypes and any mask dtype pass.
    return args[0].dtype


def _sdpa_flash_cpu(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    v = _qkv(op, args, kwargs, dev, "scalar")
    if v:
        return v
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype not in (F32, q.dtype):
        return _viol(op, "mask", "scaled_dot_product_attention_flash_attention: Attention mask is the same data "
                     "type as query", args, kwargs, [mask], q.dtype)
    return q.dtype


def _sdpa_flash_cuda(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    bad = _not_on_device(op, args, kwargs, dev, ("cuda",))
    if bad:
        return bad
    if q.dtype not in _REDUCED:
        return _viol(op, "unsupported", "FlashAttention only support fp16 and bf16 data type", args, kwargs,
                     [t for t in args[:3] if t.dtype not in _REDUCED], args[2].dtype if args[2].dtype in _REDUCED
                     else BF16)
    return _qkv(op, args, kwargs, dev, "flash_cuda") or q.dtype


def _sdpa_efficient(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    bad = _not_on_device(op, args, kwargs, dev, ("cuda",))
    if bad:
        return bad
    if q.dtype not in (F32, BF16, F16):
        return _viol(op, "unsupported", f"memory-efficient attention does not support {_sc(q.dtype)}", args, kwargs,
                     [q], F32)
    v = _qkv(op, args, kwargs, dev, "efficient_cuda")
    if v:
        return v
    bias = _arg(args, kwargs, 3, "attn_bias")
    if bias is not None and bias.dtype != q.dtype:
        return _viol(op, "mask", "invalid dtype for bias - should match query's dtype", args, kwargs, [bias], q.dtype)
    return q.dtype


def _sdpa_cudnn(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    bad = _not_on_device(op, args, kwargs, dev, ("cuda",))
    if bad:
        return bad
    if q.dtype not in _REDUCED:
        return _viol(op, "unsupported", "cuDNN attention only supports fp16 and bf16 query, key and value", args,
                     kwargs, [t for t in args[:3] if t.dtype not in _REDUCED], BF16)
    v = _qkv(op, args, kwargs, dev, "scalar")
    if v:
        return v
    bias = _arg(args, kwargs, 3, "attn_bias")
    if bias is not None and bias.dtype != q.dtype:
        return _viol(op, "mask", "cuDNN attention: attn_bias must have the query's dtype", args, kwargs, [bias],
                     q.dtype)
    return q.dtype


def _sdpa_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # flash/efficient/cudnn backward: (grad_out, q, k, v, out, ...) in one dtype, as the forward
    grad, q, k, v = args[0], args[1], args[2], args[3]
    if op == "aten._scaled_dot_product_flash_attention_for_cpu_backward":
        bad = None
    else:
        bad = _not_on_device(op, args, kwargs, dev, ("cuda",))
    if bad:
        return bad
    mismatched = [t for t in (grad, q, k) if t.dtype != v.dtype]
    if mismatched:
        found = next(t for t in (grad, k, v) if t.dtype != q.dtype)  # the kernel reads all as q's type
        return _viol(op, "mismatch", f"expected scalar type {_sc(q.dtype)} but found {_sc(found.dtype)}",
                     args, kwargs, mismatched, v.dtype)
    return q.dtype


def _sdpa_overrideable(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _qkv(op, args, kwargs, dev, "scalar") or args[0].dtype


def _fused_weights(op: str, args: Args, kwargs: Kwargs, dev: Device, x: Tensor,
                   layers: Sequence[tuple[Tensor, Tensor | None]], norms: Sequence[Tensor | None]) -> Any:
    # The fused encoder-layer / MHA kernels (transformers/attention.cpp, transformer.cpp) run
    # their projections as mm/addmm in x's dtype, so weights and biases must have x's dtype;
    # measured on CPU, the qkv bias is the exception (added by transform_bias_rescale_qkv, which
    # takes it in any float dtype). Their layer norms follow the device's layer_norm rule (CPU
    # lets a bf16/f16 x use f32 norm weights).
    weights = [w for w, _ in layers]
    if any(w.dtype != x.dtype for w in weights):
        bad = [w for w in weights if w.dtype != x.dtype]
        w0 = bad[0]
        msg = (f"expected m1 and m2 to have the same dtype, but got: {_cpp(x.dtype)} != {_cpp(w0.dtype)}"
               if w0 is weights[0] else
               f"self and mat2 must have the same dtype, but got {_sc(x.dtype)} and {_sc(w0.dtype)}")
        if len(bad) == len(weights) and len({w.dtype for w in bad}) == 1:
            # the whole layer is in another dtype: the activation is the odd one
            return _viol(op, "mismatch", msg, args, kwargs, [x], w0.dtype)
        return _viol(op, "mismatch", msg, args, kwargs, bad, x.dtype)
    bad_b = [b for i, (_, b) in enumerate(layers) if i > 0 and b is not None and b.dtype != x.dtype]
    if bad_b:
        return _viol(op, "mismatch", f"self and mat2 must have the same dtype, but got {_sc(bad_b[0].dtype)} and "
                     f"{_sc(x.dtype)}", args, kwargs, bad_b, x.dtype)
    for i in range(0, len(norms), 2):
        v = _norm_params(op, args, kwargs, dev, x, norms[i:i + 2], cuda_mixed=False)
        if v:
            return v
    return x.dtype


def _transformer_encoder_layer(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    src = args[0]
    layers = [(args[3], args[4]), (args[5], args[6]), (args[14], args[15]), (args[16], args[17])]
    norms = [args[10], args[11], args[12], args[13]]
    return _fused_weights(op, args, kwargs, dev, src, layers, norms)


def _native_mha(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q, k, v = args[0], args[1], args[2]
    if not (q.dtype == k.dtype == v.dtype):
        return _qkv(op, args, kwargs, dev, "scalar")
    return _fused_weights(op, args, kwargs, dev, q, [(args[5], args[6]), (args[7], args[8])], [])


# ---------------------------------------------------------------------------------------------
# softmax
#
# CPU measured: half_to_float is refused. CUDA: cuda/SoftMax.cu host_softmax allows
# half_to_float for Half input only and returns float32; softmax backward on CUDA takes grad f32
# with input_dtype Half ("expected input and grad types to match, or input to be at::Half and
# grad to be at::Float").


def _softmax(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    x = args[0]
    half_to_float = bool(_arg(args, kwargs, 2, "half_to_float", False))
    if not (_is_float(x.dtype) or x.dtype.is_complex):
        return _viol(op, "unsupported", f"\"softmax_lastdim_kernel_impl\" not implemented for '{_sc(x.dtype)}'", args,
                     kwargs, [x], F32)
    if half_to_float:
        if dev.kernels == "cpu":
            return _viol(op, "unsupported", "softmax with half to float conversion is not supported on CPU", args,
                         kwargs, [x], None)
        if x.dtype != F16:
            return _viol(op, "unsupported", "conversion is supported for Half type only", args, kwargs, [x], F16)
        return F32
    return x.dtype


def _softmax_dtype(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # softmax.int / log_softmax.int / _safe_softmax(self, dim, dtype=None): computes in `dtype`
    x = args[0]
    dtype = _arg(args, kwargs, 2, "dtype")
    if dtype is None and not (_is_float(x.dtype) or x.dtype.is_complex):
        return _viol(op, "unsupported", f"\"softmax_lastdim_kernel_impl\" not implemented for '{_sc(x.dtype)}'", args,
                     kwargs, [x], F32)
    return dtype if dtype is not None else x.dtype


def _softmax_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    go, out = args[0], args[1]
    input_dtype = _arg(args, kwargs, 3, "input_dtype")
    if go.dtype != out.dtype:
        return _viol(op, "mismatch", f"expected scalar type {_sc(go.dtype)} but found {_sc(out.dtype)}", args, kwargs,
                     [out], go.dtype)
    if input_dtype is not None and input_dtype != go.dtype:
        if dev.kernels == "cuda":
            if not (go.dtype == F32 and input_dtype == F16):
                return _viol(op, "mismatch", "expected input and grad types to match, or input to be at::Half and "
                             "grad to be at::Float", args, kwargs, [go], input_dtype)
            return F16
        if go.dtype == F32 and input_dtype == F16:  # CPU measured: the half_to_float backward is refused
            return _viol(op, "unsupported", "expected scalar type Float but found Half", args, kwargs, [go], F16)
    return go.dtype


# ---------------------------------------------------------------------------------------------
# embedding and indexing (device-agnostic checks in Embedding.cpp, TensorAdvancedIndexing.cpp,
# ScatterGatherChecks.h, IndexingUtils.h; CPU messages measured)


def _embedding(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    w, idx = args[0], args[1]
    if idx.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "Expected tensor for argument #1 'indices' to have one of the following scalar "
                     f"types: Long, Int; but got {_legacy(idx.dtype, dev)} instead (while checking arguments for "
                     "embedding)", args, kwargs, [idx], I64)
    return w.dtype


def _embedding_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    g, idx = args[0], args[1]
    if idx.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "Expected tensor for argument #2 'indices' to have one of the following scalar "
                     f"types: Long, Int; but got {_legacy(idx.dtype, dev)} instead (while checking arguments for "
                     "embedding_backward)", args, kwargs, [idx], I64)
    return g.dtype


def _check_indices(op: str, args: Args, kwargs: Kwargs, indices: Sequence[Tensor | None]) -> Violation | None:
    for i in indices:
        if i is not None and i.dtype not in (I64, I32, U8, BOOL):
            return _viol(op, "index", "tensors used as indices must be long, int, byte or bool tensors", args, kwargs,
                         [i], I64)
    return None


def _index_put(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, indices, values = args[0], args[1], args[2]
    v = _check_indices(op, args, kwargs, indices)
    if v:
        return v
    if values.dtype != s.dtype:
        return _viol(op, "index", f"Index put requires the source and destination dtypes match, got "
                     f"{_sc(s.dtype)} for the destination and {_sc(values.dtype)} for the source.", args, kwargs,
                     [values], s.dtype)
    return s.dtype


def _index(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _check_indices(op, args, kwargs, args[1]) or args[0].dtype


def _masked_scatter(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, mask, src = args[0], args[1], args[2]
    if mask.dtype != BOOL:
        return _viol(op, "mask", f"masked_scatter_ only supports boolean masks, but got mask with dtype "
                     f"{_sc(mask.dtype)}", args, kwargs, [mask], BOOL)
    if src.dtype != s.dtype:
        return _viol(op, "index", f"masked_scatter: expected self and source to have same dtypes but got"
                     f"{_sc(s.dtype)} and {_sc(src.dtype)}", args, kwargs, [src], s.dtype)
    return s.dtype


def _masked_fill(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, mask, value = args[0], args[1], args[2]
    if mask.dtype != BOOL:
        return _viol(op, "mask", f"masked_fill_ only supports boolean masks, but got mask with dtype "
                     f"{_cpp(mask.dtype)}", args, kwargs, [mask], BOOL)
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        return _viol(op, "mask", f"masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
                     f"{value.dim()} dimension(s).", args, kwargs, [value], None)
    return s.dtype  # the value is cast to self's dtype


def _scatter(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index = args[0], args[2]
    src = args[3] if len(args) > 3 else kwargs.get("src")
    if index.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "scatter(): Expected dtype int32/int64 for index", args, kwargs, [index], I64)
    if isinstance(src, torch.Tensor) and src.dtype != s.dtype:
        return _viol(op, "index", "scatter(): Expected self.dtype to be equal to src.dtype", args, kwargs, [src],
                     s.dtype)
    return s.dtype


def _gather(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index = args[0], args[2]
    if index.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "gather(): Expected dtype int32/int64 for index", args, kwargs, [index], I64)
    return s.dtype


def _index_select(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index = args[0], args[2]
    if index.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "index_select(): Expected dtype int32 or int64 for index", args, kwargs, [index],
                     I64)
    return s.dtype


def _index_copy(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index, src = args[0], args[2], args[3]
    if index.dtype != I64:
        return _viol(op, "index", f"index_copy_(): Expected a long tensor for index, but got {_sc(index.dtype)}", args,
                     kwargs, [index], I64)
    if src.dtype != s.dtype:
        return _viol(op, "index", f"index_copy_(): self and source expected to have the same dtype, but got (self) "
                     f"{_sc(s.dtype)} and (source) {_sc(src.dtype)}", args, kwargs, [src], s.dtype)
    return s.dtype


def _index_add(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    s, index, src = args[0], args[2], args[3]
    if index.dtype not in _INDEX_TYPES:
        return _viol(op, "index", "index_add_(): Expected dtype int32/int64 for index", args, kwargs, [index], I64)
    if src.dtype != s.dtype:
        return _viol(op, "index", f"index_add_(): self ({_sc(s.dtype)}) and source ({_sc(src.dtype)}) must have the "
                     "same scalar type", args, kwargs, [src], s.dtype)
    return s.dtype


def _where(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    cond = args[0]
    if cond.dtype not in (BOOL, U8):  # uint8 still accepted, with a deprecation warning
        return _viol(op, "mask", f"where expected condition to be a boolean tensor, but got a tensor with dtype "
                     f"{_sc(cond.dtype)}", args, kwargs, [cond], BOOL)
    return result_type(args[1:3])


# ---------------------------------------------------------------------------------------------
# losses (Loss.cpp, LossNLL.cpp; CPU measured, the checks are device-agnostic)


def _loss_input(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # huber_loss / mse_loss_backward / smooth_l1_loss_backward return the input's dtype
    x = args[1] if op.endswith("_backward") else args[0]
    return x.dtype


def _loss_target(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return args[1].dtype  # binary_cross_entropy_with_logits computes in the target's dtype (measured)


def _loss_same(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # binary_cross_entropy(input, target, ...) / huber_loss_backward(grad, input, target, ...)
    backward = op.endswith("_backward")
    x = args[1] if backward else args[0]
    others = [args[0], args[2]] if backward else [args[1]]
    bad = [a for a in others if isinstance(a, torch.Tensor) and a.dtype != x.dtype]
    if bad:
        return _viol(op, "mismatch", f"Found dtype {_sc(bad[0].dtype)} but expected {_sc(x.dtype)}", args, kwargs, bad,
                     x.dtype)
    return x.dtype


def _nll_loss(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    x, target = args[0], args[1]
    weight = _arg(args, kwargs, 2, "weight")
    if target.dtype not in (I64, U8):
        return _viol(op, "index", f"expected target dtype to be Long or Byte, but got {_sc(target.dtype)}", args,
                     kwargs, [target], I64)
    if weight is not None and weight.dtype != x.dtype:
        return _viol(op, "mismatch", f"expected scalar type {_sc(x.dtype)} but found {_sc(weight.dtype)}", args,
                     kwargs, [weight], x.dtype)
    return x.dtype


def _nll_loss_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    grad, x, target = args[0], args[1], args[2]
    weight, total = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 6, "total_weight")
    if target.dtype not in (I64, U8):
        return _viol(op, "index", f"expected target dtype to be Long or Byte, but got {_sc(target.dtype)}", args,
                     kwargs, [target], I64)
    bad = [a for a in (grad, weight, total) if isinstance(a, torch.Tensor) and a.dtype != x.dtype]
    if bad:
        return _viol(op, "mismatch", f"expected scalar type {_sc(x.dtype)} but found {_sc(bad[0].dtype)}", args,
                     kwargs, bad, x.dtype)
    return x.dtype


# ---------------------------------------------------------------------------------------------
# pointwise: promotion, in-place castability, strict ops


def _promoting(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return result_type([*args, *kwargs.values()])


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
    if end.dtype != s.dtype:
        return _viol(op, "strict", f"expected dtype {_cpp(s.dtype)} for `end` but got dtype {_cpp(end.dtype)}", args,
                     kwargs, [end], s.dtype)
    if isinstance(weight, torch.Tensor) and weight.dim() > 0 and weight.dtype != s.dtype:
        return _viol(op, "strict", f"expected dtype {_cpp(s.dtype)} for `weight` but got dtype {_cpp(weight.dtype)}",
                     args, kwargs, [weight], s.dtype)
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


def _to_copy(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    dtype = kwargs.get("dtype")
    return dtype if dtype is not None else args[0].dtype


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


def _reduce_keep(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    dtype = kwargs.get("dtype")
    return dtype if dtype is not None else args[0].dtype


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
        return _viol(op, "unsupported", "mean(): could not infer output dtype. Input dtype must be either a floating "
                     f"point or complex dtype. Got: {_sc(x.dtype)}", args, kwargs, [x], F32)
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


@dataclass(frozen=True)
class _NoKernel:
    cpu: str | None  # message on CPU ("{sc}" is the dtype's scalar name), None: CPU accepts
    cuda: str | None  # message on CUDA, None: CUDA accepts
    cuda_half: bool = False  # CUDA accepts f16 (refuses only bf16)
    result: str = "same"  # "same" | "complex" | "real": result dtype from the input's
    arg: int = 0  # the argument whose dtype the kernel dispatches on


def _nk(cpu_kernel: str | None, cuda_kernel: str | None, **kw: Any) -> _NoKernel:
    def msg(kernel: str | None) -> str | None:
        return None if kernel is None else f"\"{kernel}\" not implemented for '{{sc}}'"
    return _NoKernel(msg(cpu_kernel), msg(cuda_kernel), **kw)


def _special(name: str) -> _NoKernel:
    # UnarySpecialOpsKernel.cu / the special-function .cu files: AT_DISPATCH_FLOATING_TYPES
    # "<name>_cuda" (verified for bessel_j0, erfcx, ndtri, zeta)
    return _nk(f"{name}_cpu", f"{name}_cuda")


_LOW_PRECISION = "{name}: Low precision dtypes not supported. Got {{sc}}"
_EPSILON = "This function doesn't handle types other than float and double"
_MKL_FFT = "MKL FFT doesn't support tensors of type: {sc}"
_CUFFT = "cuFFT doesn't support tensor of type: {sc}"

# keys: "aten.op" for every overload, "aten.op.overload" for one
_NO_KERNEL: dict[str, _NoKernel] = {
    "aten.linalg_qr": _nk("geqrf_cpu", "geqrf_cuda"),
    "aten.geqrf": _nk("geqrf_cpu", "geqrf_cuda"),
    "aten.linalg_householder_product": _nk("orgqr_cpu", "orgqr_cuda"),
    "aten.linalg_cholesky_ex": _nk("cholesky_cpu", "cholesky_cuda"),
    "aten.cholesky_solve": _nk("cholesky_solve_cpu", "cholesky_solve_cuda"),
    "aten._cholesky_solve_helper": _nk("cholesky_solve_cpu", "cholesky_solve_cuda"),
    "aten.cholesky_inverse": _nk("cholesky_inverse_out_cpu", "cholesky_inverse_cuda"),
    "aten.linalg_lu_factor_ex": _nk("lu_cpu", "lu_cuda"),
    "aten.linalg_lu": _nk("lu_cpu", "lu_cuda"),
    "aten._linalg_det": _nk("lu_cpu", "lu_cuda"),
    "aten._linalg_solve_ex": _nk("lu_cpu", "lu_cuda"),
    "aten.linalg_solve_triangular": _nk("triangular_solve_cpu", "triangular_solve_cuda"),
    "aten._linalg_svd": _nk("linalg_svd_cpu", "svd_cuda"),
    "aten._linalg_eigh": _nk("linalg_eigh_cpu", "linalg_eigh_cuda"),
    "aten.linalg_eig": _nk("linalg_eig_out_cpu", "linalg_eig_cuda", result="complex"),
    "aten.linalg_ldl_factor_ex": _nk("ldl_factor_kernel_cpu", "ldl_factor_cuda"),
    "aten.linalg_inv_ex": _NoKernel(_LOW_PRECISION.format(name="linalg.inv"),
                                    _LOW_PRECISION.format(name="linalg.inv")),
    "aten._linalg_slogdet": _NoKernel(_LOW_PRECISION.format(name="linalg.slogdet"),
                                      _LOW_PRECISION.format(name="linalg.slogdet")),
    "aten.linalg_lstsq": _NoKernel(_EPSILON, _EPSILON),
    "aten._cdist_forward": _nk("cdist", "cdist_cuda"),
    "aten._pdist_forward": _nk("pdist", "pdist_cuda"),
    "aten._ctc_loss": _nk("ctc_loss_cpu", "ctc_loss_cuda"),
    "aten.special_ndtri": _special("ndtri"),
    "aten.special_zeta": _special("zeta"),
    "aten.special_erfcx": _special("erfcx"),
    "aten.special_log_ndtr": _special("log_ndtr"),
    **{f"aten.special_{n}": _special(n) for n in (
        "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
        "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
        "spherical_bessel_j0", "airy_ai")},
    # the polynomials' Tensor-Tensor overload only: the Scalar overloads put no tensor first
    **{f"aten.special_{n}.default": _special(n) for n in (
        "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
        "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
        "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
        "legendre_polynomial_p")},
    # histogramdd's CPU kernel only (no CUDA kernel at all); histogram with a bins tensor and histc
    # have bf16/f16 CPU kernels
    "aten.histogram.bin_ct": _nk("histogramdd", None),
    "aten._histogramdd_bin_edges": _nk("histogramdd", None),
    "aten._histogramdd_from_bin_cts": _nk("histogramdd", None),
    # CUDA kernels of these take Half and BFloat16 (AveragePool3d.cu, MultiMarginLoss.cu,
    # MultiLabelMarginCriterion.cu: AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16); the
    # antialiased upsampling and gamma kernels are taken to do the same, not read): CPU only
    "aten.avg_pool3d": _nk("avg_pool3d_out_frame", None),
    "aten.avg_pool3d_backward": _nk("avg_pool3d_backward_out_frame", None),
    "aten._upsample_bilinear2d_aa": _nk("compute_index_ranges_weights", None),
    "aten._upsample_bicubic2d_aa": _nk("compute_index_ranges_weights", None),
    "aten._upsample_bilinear2d_aa_backward": _nk("upsample_bilinear2d_aa_backward_cpu", None),
    "aten.multilabel_margin_loss_forward": _nk("multilabel_margin_loss_forward_out_frame", None),
    "aten.multilabel_margin_loss_backward": _nk("multilabel_margin_loss_backward_out_frame", None, arg=1),
    "aten.multi_margin_loss": _nk("multi_margin_loss_cpu_kernel", None),
    "aten._standard_gamma": _nk("gamma_cpu", None),
    "aten._standard_gamma_grad": _nk("_standard_gamma_grad_cpu", None),
    "aten.binomial": _nk("binomial_cpu", None),
    "aten._sample_dirichlet": _nk("dirichlet", None),
    "aten._fft_r2c": _NoKernel(_MKL_FFT, _CUFFT, cuda_half=True, result="complex"),
    "aten._fft_c2c": _NoKernel(_MKL_FFT, _CUFFT, cuda_half=True),
    "aten._fft_c2r": _NoKernel(_MKL_FFT, _CUFFT, cuda_half=True, result="real"),
}
_CPU_ONLY = ("aten.histogram.bin_ct", "aten._histogramdd_bin_edges", "aten._histogramdd_from_bin_cts")
_COMPLEX_OF = {F32: torch.complex64, F64: torch.complex128, F16: torch.complex32, BF16: torch.complex32}


def _cdist_uses_mm(args: Args, kwargs: Kwargs) -> bool:
    # Distance.cpp cdist_impl: p == 2 goes through _euclidean_dist (matmul, any float dtype) when
    # compute_mode is 1, or None/0 and either input has more than 25 rows; only the direct
    # kernel lacks bf16/f16
    x1, x2 = args[0], args[1]
    p = _arg(args, kwargs, 2, "p")
    mode = _arg(args, kwargs, 3, "compute_mode")
    if p != 2:
        return False
    return mode == 1 or (mode in (None, 0) and (x1.size(-2) > 25 or x2.size(-2) > 25))


def _fft_sizes_pow2(op: str, args: Args, kwargs: Kwargs) -> bool:
    x = args[0]
    dims = list(_arg(args, kwargs, 1, "dim"))
    sizes = [x.size(d) for d in dims]
    if op == "aten._fft_c2r" and sizes:
        sizes[-1] = int(_arg(args, kwargs, 3, "last_dim_size"))
    return all(s > 0 and s & (s - 1) == 0 for s in sizes)


def _no_kernel_rule(key: str, spec: _NoKernel) -> Rule:
    """The rule for one op of ``_NO_KERNEL``; the spec is bound here, so a call is no lookup."""
    cpu_only = key in _CPU_ONLY

    def rule(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
        x = args[spec.arg]
        if dev.kernels == "cuda" and cpu_only:
            return _not_on_device(op, args, kwargs, dev, ("cpu",))
        # the complex FFTs name the value type: complex32 reads "Half"
        value = x.dtype.to_real() if x.dtype.is_complex else x.dtype
        if value in _REDUCED and not (op == "aten._cdist_forward" and _cdist_uses_mm(args, kwargs)):
            msg = spec.cuda if dev.kernels == "cuda" else spec.cpu
            if dev.kernels == "cuda" and spec.cuda_half and value == F16:
                if not _fft_sizes_pow2(op, args, kwargs):
                    return _viol(op, "unsupported", "cuFFT only supports dimensions whose sizes are powers of two "
                                 "when computing in half precision", args, kwargs, [x], F32)
                msg = None
            if msg is not None:
                want = torch.complex64 if x.dtype.is_complex else F32
                return _viol(op, "unsupported", msg.format(sc=_sc(value)), args, kwargs, [x], want)
        if spec.result == "complex":
            return _COMPLEX_OF.get(x.dtype, x.dtype)
        if spec.result == "real" and x.dtype.is_complex:
            return value
        return x.dtype

    return rule


def _rrelu(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # CPU measured: only the training path samples noise, in a kernel without Half
    x = args[0]
    if dev.kernels == "cpu" and x.dtype == F16 and _arg(args, kwargs, 4, "training", False):
        return _viol(op, "unsupported", "\"rrelu_with_noise_out_cpu\" not implemented for 'Half'", args, kwargs, [x],
                     F32)
    return _float_only(op, args, kwargs, dev)


_COMPLEX_PARTS = (F16, F32, F64)


def _complex_ctor(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # TensorFactories.cpp complex_check_dtype, device-agnostic (CPU measured): Half, Float or
    # Double parts (no bf16: there is no bf16 complex type), both of one dtype
    a, b = args[0], args[1]
    if a.dtype not in _COMPLEX_PARTS or b.dtype not in _COMPLEX_PARTS:
        return _viol(op, "unsupported", f"Expected both inputs to be Half, Float or Double tensors but got "
                     f"{_sc(a.dtype)} and {_sc(b.dtype)}", args, kwargs,
                     [t for t in (a, b) if t.dtype not in _COMPLEX_PARTS], F32)
    if a.dtype != b.dtype:
        return _viol(op, "mismatch", f"Expected object of scalar type {_sc(a.dtype)} but got scalar type "
                     f"{_sc(b.dtype)} for second argument", args, kwargs, [b], a.dtype)
    return _COMPLEX_OF[a.dtype]


# ---------------------------------------------------------------------------------------------
# the table (keys: "aten.op" for every overload, or "aten.op.overload" for one)

_TABLE: dict[str, Rule] = {}


def _register(rule: Rule, *names: str) -> None:
    for n in names:
        _TABLE[n if n.startswith(("aten.", "prim.", "profiler.")) else f"aten.{n}"] = rule


_register(_mm, "mm", "bmm", "dot", "vdot", "mv", "matmul")
_register(_addmm, "addmm", "addmm_", "_addmm_activation", "addbmm", "addbmm_")
_register(_linear, "linear")
_register(_baddbmm, "baddbmm", "baddbmm_")
_register(_addmv, "addmv", "addmv_")
_register(_conv, "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
          "conv_transpose2d", "conv_transpose3d", "_convolution_mode", "mkldnn_convolution",
          "_slow_conv2d_forward", "slow_conv3d_forward", "thnn_conv2d", "slow_conv_transpose2d",
          "slow_conv_transpose3d", "cudnn_convolution_relu", "cudnn_convolution_add_relu",
          "miopen_convolution")
_register(_conv_nobias, "cudnn_convolution", "cudnn_convolution_transpose")
_register(_conv_backward, "convolution_backward")
_register(_layer_norm, "native_layer_norm", "layer_norm")
_register(_group_norm, "native_group_norm", "group_norm")
_register(_batch_norm, "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
          "_native_batch_norm_legit_functional", "_batch_norm_with_update", "_batch_norm_with_update_functional",
          "_batch_norm_no_update", "cudnn_batch_norm", "miopen_batch_norm", "batch_norm")
_register(_layer_norm_backward, "native_layer_norm_backward")
_register(_group_norm_backward, "native_group_norm_backward")
_register(_batch_norm_backward, "native_batch_norm_backward")
_register(_rms_norm, "rms_norm", "_fused_rms_norm")
_register(_sdpa, "scaled_dot_product_attention")
_register(_sdpa_math, "_scaled_dot_product_attention_math", "_scaled_dot_product_attention_math_for_mps")
_register(_sdpa_flash_cpu, "_scaled_dot_product_flash_attention_for_cpu")
_register(_sdpa_flash_cuda, "_scaled_dot_product_flash_attention", "_flash_attention_forward")
_register(_sdpa_efficient, "_scaled_dot_product_efficient_attention", "_efficient_attention_forward")
_register(_sdpa_cudnn, "_scaled_dot_product_cudnn_attention")
_register(_sdpa_overrideable, "_scaled_dot_product_fused_attention_overrideable")
_register(_transformer_encoder_layer, "_transformer_encoder_layer_fwd")
_register(_native_mha, "_native_multi_head_attention")
_register(_softmax, "_softmax", "_log_softmax")
_register(_softmax_dtype, "_safe_softmax", "softmax", "log_softmax", "special_softmax", "special_log_softmax")
_register(_sdpa_backward, "_scaled_dot_product_flash_attention_for_cpu_backward",
          "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
          "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward", "_efficient_attention_backward")
_register(_softmax_backward, "_softmax_backward_data", "_log_softmax_backward_data")
_register(_embedding, "embedding")
_register(_embedding_backward, "embedding_dense_backward", "embedding_backward")
_register(_index_put, "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index_put")
_register(_index, "index", "_unsafe_index")
_register(_masked_scatter, "masked_scatter", "masked_scatter_")
_register(_masked_fill, "masked_fill", "masked_fill_")
_register(_scatter, "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_")
_register(_gather, "gather")
_register(_index_select, "index_select")
_register(_index_copy, "index_copy", "index_copy_")
_register(_index_add, "index_add", "index_add_")
_register(_where, "where")
_register(_loss_input, "huber_loss", "mse_loss_backward", "smooth_l1_loss_backward")
_register(_loss_target, "binary_cross_entropy_with_logits")
_register(_loss_same, "binary_cross_entropy", "huber_loss_backward")
_register(_nll_loss, "nll_loss_forward", "nll_loss2d_forward")
_register(_nll_loss_backward, "nll_loss_backward", "nll_loss2d_backward")
_register(_promoting, "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div")
_register(_lerp, "lerp", "lerp_")
_register(_copy, "copy_", "copy", "_copy_from", "_copy_from_and_resize", "fill_", "fill", "zero_", "index_fill",
          "index_fill_", "masked_select", "take", "put_", "put")
_register(_inplace, "add_", "sub_", "mul_", "addcmul_", "addcdiv_", "clamp_", "clamp_min_", "clamp_max_", "pow_",
          "fmod_", "remainder_", "maximum_", "minimum_", "atan2_", "hypot_", "copysign_", "rsub_", "xlogy_",
          "bitwise_and_", "bitwise_or_", "bitwise_xor_", "logical_and_", "logical_or_", "floor_divide_")
_register(_inplace_div, "div_", "true_divide_")
_register(_true_divide, "div", "true_divide")
_register(_promoting, "add", "sub", "rsub", "mul", "addcmul", "addcdiv", "maximum", "minimum", "fmax", "fmin",
          "pow", "atan2", "hypot", "remainder", "fmod", "floor_divide", "copysign", "xlogy", "clamp", "clamp_min",
          "clamp_max", "clip", "bitwise_and", "bitwise_or", "bitwise_xor", "threshold_backward", "gelu_backward",
          "silu_backward", "sigmoid_backward", "tanh_backward", "hardswish_backward", "hardsigmoid_backward",
          "leaky_relu_backward", "elu_backward", "softplus_backward", "mish_backward", "hardtanh_backward",
          "_prelu_kernel", "prelu", "heaviside", "nextafter", "logaddexp", "logaddexp2")
_register(_comparison, "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
          "logical_not", "isnan", "isinf", "isfinite", "isneginf", "isposinf", "signbit", "isclose", "equal",
          "any", "all")
_register(_cat, "cat", "stack", "hstack", "vstack", "_cat", "concat", "concatenate", "dstack")
_register(_float_unary, "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos",
          "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf",
          "erfc", "erfinv", "reciprocal", "lgamma", "digamma", "sinc", "logit", "i0",
          "logsumexp")
_register(_float_only, "gelu", "gelu_", "silu", "silu_", "mish", "mish_", "hardswish", "hardswish_",
          "hardsigmoid", "hardsigmoid_", "elu", "elu_", "selu", "selu_", "celu", "celu_", "leaky_relu",
          "leaky_relu_", "softplus", "log_sigmoid_forward", "native_dropout", "dropout",
          "feature_dropout", "alpha_dropout", "glu", "grid_sampler_2d",
          "native_dropout_backward", "normal_", "uniform_", "exponential_", "cauchy_", "log_normal_")
# dtype-neutral: views, layout and value-selection ops return their input's dtype
_NEUTRAL = """
    relu relu_ neg neg_ abs abs_ sign sgn floor ceil round trunc frac square clone contiguous detach
    detach_ alias lift_fresh lift_fresh_copy view _unsafe_view reshape _reshape_alias t t_ transpose
    transpose_ permute expand expand_as squeeze squeeze_ unsqueeze unsqueeze_ select slice split
    split_with_sizes unsafe_split chunk unbind narrow as_strided as_strided_ flatten unflatten
    movedim repeat repeat_interleave roll flip tril triu tril_ triu_ constant_pad_nd pad
    reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d diagonal view_as_real
    view_as_complex _conj conj resolve_conj resolve_neg hardtanh hardtanh_ threshold threshold_
    relu6 sort topk max_pool2d_with_indices max_pool1d max_pool2d max_pool3d_with_indices
    _adaptive_max_pool2d adaptive_max_pool2d cummax cummin kthvalue median nanmedian mode msort amax
    amin max min aminmax var std var_mean std_mean _unique2 unique_dim unique_consecutive
    upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_bilinear2d upsample_linear1d
    upsample_bicubic2d _upsample_nearest_exact2d avg_pool1d avg_pool2d
    _adaptive_avg_pool2d _adaptive_avg_pool3d adaptive_avg_pool1d slice_scatter
    select_scatter diagonal_scatter as_strided_scatter index_put_with_sort _nested_tensor_from_mask
    _nested_tensor_from_mask_left_aligned to_padded_tensor _nested_from_padded randint_like resize_
    resize_as_ set_ _to_dense unfold im2col col2im pixel_shuffle pixel_unshuffle channel_shuffle
    native_channel_shuffle bernoulli bernoulli_ geometric_ _unsafe_view_copy view_copy expand_copy permute_copy
    transpose_copy t_copy unsqueeze_copy squeeze_copy select_copy slice_copy split_copy alias_copy
    detach_copy diagonal_copy as_strided_copy unbind_copy _nested_view_from_buffer
    max_pool2d_with_indices_backward avg_pool2d_backward _adaptive_avg_pool2d_backward
    upsample_nearest2d_backward upsample_bilinear2d_backward reflection_pad2d_backward
    constant_pad_nd_backward slice_backward select_backward diagonal_backward unfold_backward
""".split()  # noqa: SIM905  (a word list reads better than 200 quoted names)
_register(_same_as_self, *_NEUTRAL)
_register(_like, "empty_like", "zeros_like", "ones_like", "rand_like", "randn_like", "full_like", "new_empty",
          "new_zeros", "new_ones", "new_full", "new_empty_strided")
_register(_to_copy, "_to_copy")
_register(_to, "to", "type_as")
_register(_factory, "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange",
          "linspace", "logspace", "scalar_tensor", "empty_strided", "eye", "tensor", "_efficientzerotensor",
          "zeros_symint")
_register(_reduce_sum, "sum", "nansum", "cumsum", "prod", "cumsum_", "cumprod", "trace")
_register(_reduce_keep, "norm", "linalg_vector_norm", "_linalg_vector_norm", "frobenius_norm", "nanmean")
_register(_mean, "mean")
_register(_to_long, "argmax", "argmin", "nonzero", "argsort", "bucketize", "searchsorted", "count_nonzero")
_register(_promoting, "max.other", "min.other")
for _key, _spec in _NO_KERNEL.items():
    _register(_no_kernel_rule(_key, _spec), _key)
_register(_rrelu, "rrelu_with_noise")
_register(_same_as_self, "histogram", "histc")  # bin counts in the input's dtype (bin_ct is above)
_register(_complex_ctor, "polar", "complex")
_register(_no_tensor, "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
          "is_same_size", "_assert_async", "_assert_tensor_metadata", "_functional_assert_async",
          "record_stream", "_assert_scalar", "sym_constrain_range_for_size", "_print", "prim.device", "prim.layout",
          "profiler._record_function_enter", "profiler._record_function_enter_new", "profiler._record_function_exit")

_CACHE: dict[Any, tuple[Rule, str] | None] = {}


def _rule(func: torch._ops.OpOverload) -> tuple[Rule, str] | None:
    try:
        return _CACHE[func]
    except KeyError:
        pass
    entry: tuple[Rule, str] | None = None
    try:
        packet = f"{func.namespace}.{func._opname}"
        rule = _TABLE.get(f"{packet}.{func._overloadname}") or _TABLE.get(packet)
        if rule is not None:
            entry = (rule, packet)
    except AttributeError:  # not an OpOverload (e.g. a HigherOrderOperator)
        pass
    _CACHE[func] = entry
    return entry


def _outcome(func: torch._ops.OpOverload, args: Args, kwargs: Kwargs, device: Device | str) -> Any:
    dev = get_device(device)
    entry = _rule(func)
    if dev.contracts and entry is not None:
        # the device's own rule for this op replaces its kernel family's
        entry = (dev.contracts.get(entry[1], entry[0]), entry[1])
    elif dev.contracts:
        entry = _delta_rule(func, dev)
    if entry is None:
        return None
    rule, name = entry
    args, kwargs = tuple(args), dict(kwargs or {})
    try:
        return rule(name, args, kwargs, dev)
    except _NoPromotion as e:
        float8 = [d for d in e.dtypes if d.itemsize == 1 and d.is_floating_point] or list(e.dtypes)
        culprits = [t for t in tensor_args(args, kwargs) if t.dtype in float8]
        return _viol(name, "unsupported", str(e), args, kwargs, culprits, None)
    except (IndexError, AttributeError, TypeError, KeyError, ValueError, StopIteration):
        # an overload whose arguments the rule does not model (e.g. an out= variant): no claim,
        # and never an exception on the tracer's hot path
        return None


def _delta_rule(func: torch._ops.OpOverload, dev: Device) -> tuple[Rule, str] | None:
    """A device delta for an op the family table does not know."""
    try:
        packet = f"{func.namespace}.{func._opname}"
    except AttributeError:
        return None
    rule = dev.contracts.get(f"{packet}.{func._overloadname}") or dev.contracts.get(packet)
    return (rule, packet) if rule is not None else None


def check(func: torch._ops.OpOverload, args: Args, kwargs: Kwargs, device: Device | str) -> Violation | None:
    """The violation the real kernel on ``device`` (a Device or a registered name) would raise, or None."""
    out = _outcome(func, args, kwargs, device)
    return out if isinstance(out, Violation) else None


def result_dtype(func: torch._ops.OpOverload, args: Args, kwargs: Kwargs,
                 device: Device | str) -> torch.dtype | None:
    """The dtype of the (first) tensor the real kernel returns when it accepts; None when the op is
    not in the table or the kernel refuses."""
    out = _outcome(func, args, kwargs, device)
    return out if isinstance(out, torch.dtype) else None


def is_covered(func: torch._ops.OpOverload) -> bool:
    """True if the table knows this op (dtype-agnostic view/metadata ops count as covered)."""
    return _rule(func) is not None
