"""Contracts for attention (sdpa and its kernels, fused encoder layers, MHA) and softmax."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from castwise.devices import Device
from castwise.trace.contracts._base import (
    _REDUCED,
    BF16,
    BOOL,
    F16,
    F32,
    Args,
    Kwargs,
    Tensor,
    Violation,
    _arg,
    _cpp,
    _is_float,
    _not_on_device,
    _sc,
    _scalar,
    _viol,
)
from castwise.trace.contracts.norm import _norm_params


def _qkv(op: str, args: Args, kwargs: Kwargs, dev: Device, msg_style: str) -> Violation | None:
    q, k, v = args[0], args[1], args[2]
    if q.dtype == k.dtype == v.dtype:
        return None
    # v is the reference: it comes straight from a projection, while q and k go through norms and
    # rotary embeddings, which is where an up-cast usually happens (story 4)
    culprits, ref = [t for t in (q, k) if t.dtype != v.dtype], v.dtype
    if msg_style == "composite":
        msg = (
            f"Expected query, key, and value to have the same dtype, but got query.dtype: {_cpp(q.dtype)} "
            f"key.dtype: {_cpp(k.dtype)} and value.dtype: {_cpp(v.dtype)} instead."
        )
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


def _sdpa(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    v = _qkv(op, args, kwargs, dev, "composite")
    if v:
        return v
    mask = _arg(args, kwargs, 3, "attn_mask")
    if mask is not None and mask.dtype not in (BOOL, F32, q.dtype):
        return _viol(
            op,
            "mask",
            f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
            f"attn_mask.dtype: {_cpp(mask.dtype)} and  query.dtype: {_cpp(q.dtype)} instead.",
            args,
            kwargs,
            [mask],
            q.dtype,
        )
    # On CUDA too a float32 mask with f16/bf16 q/k/v is taken, whichever kernel runs (measured on
    # H100, head sizes 4 and 16: sdpa converts the mask before the memory-efficient kernel, whose
    # own bias check is the _sdpa_efficient rule below).
    return q.dtype


def _sdpa_math(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # CPU measured: the math kernel upcasts reduced q/k/v to float32 and casts the result back
    # to q's dtype, so mixed dtypes and any mask dtype pass.
    return args[0].dtype


def _sdpa_flash_cpu(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    bad = _not_on_device(op, args, kwargs, dev, ("cpu",))  # a CPU-only kernel (measured on CUDA)
    if bad:
        return bad
    v = _qkv(op, args, kwargs, dev, "scalar")
    if v:
        return v
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype not in (F32, q.dtype):
        return _viol(
            op,
            "mask",
            "scaled_dot_product_attention_flash_attention: Attention mask is the same data type as query",
            args,
            kwargs,
            [mask],
            q.dtype,
        )
    return q.dtype


def _sdpa_flash_cuda(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    bad = _not_on_device(op, args, kwargs, dev, ("cuda",))
    if bad:
        return bad
    if q.dtype not in _REDUCED:
        v = args[2].dtype if args[2].dtype in _REDUCED else BF16  # v's dtype where v is 16-bit
        return _half_only(op, args, kwargs, "FlashAttention only support fp16 and bf16 data type", v)
    if isinstance(q.shape[-1], int) and q.shape[-1] % 8:
        return _viol(
            op, "unsupported", "head_size must be a multiple of 8, this is ensured by padding!", args, kwargs, [q], None
        )
    return _qkv(op, args, kwargs, dev, "flash_cuda") or q.dtype


def _half_only(op: str, args: Args, kwargs: Kwargs, message: str, expected: torch.dtype) -> Violation:
    # the flash and cuDNN kernels take f16/bf16 only: each of q, k, v in another dtype is at fault
    culprits = [t for t in args[:3] if t.dtype not in _REDUCED]
    return _viol(op, "unsupported", message, args, kwargs, culprits, expected)


def _sdpa_efficient(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    bad = _not_on_device(op, args, kwargs, dev, ("cuda",))
    if bad:
        return bad
    if q.dtype not in (F32, BF16, F16):
        return _viol(
            op, "unsupported", f"memory-efficient attention does not support {_sc(q.dtype)}", args, kwargs, [q], F32
        )
    return _qkv_bias(op, args, kwargs, dev, "efficient_cuda", "invalid dtype for bias - should match query's dtype")


def _sdpa_cudnn(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q = args[0]
    bad = _not_on_device(op, args, kwargs, dev, ("cuda",))
    if bad:
        return bad
    if q.dtype not in _REDUCED:
        return _half_only(op, args, kwargs, "cuDNN attention only supports fp16 and bf16 query, key and value", BF16)
    return _qkv_bias(op, args, kwargs, dev, "scalar", "cuDNN attention: attn_bias must have the query's dtype")


def _qkv_bias(op: str, args: Args, kwargs: Kwargs, dev: Device, msg_style: str, bias_message: str) -> Any:
    # the memory-efficient and cuDNN kernels: q, k, v in one dtype, then an attn_bias in q's
    q = args[0]
    v = _qkv(op, args, kwargs, dev, msg_style)
    if v:
        return v
    bias = _arg(args, kwargs, 3, "attn_bias")
    if bias is not None and bias.dtype != q.dtype:
        return _viol(op, "mask", bias_message, args, kwargs, [bias], q.dtype)
    return q.dtype


def _sdpa_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # flash/efficient/cudnn backward: (grad_out, q, k, v, out, ...) in one dtype, as the forward
    grad, q, k, v = args[0], args[1], args[2], args[3]
    cpu = op == "aten._scaled_dot_product_flash_attention_for_cpu_backward"
    bad = _not_on_device(op, args, kwargs, dev, ("cpu",) if cpu else ("cuda",))
    if bad:
        return bad
    mismatched = [t for t in (grad, q, k) if t.dtype != v.dtype]
    if mismatched:
        found = next(t for t in (grad, k, v) if t.dtype != q.dtype)  # the kernel reads all as q's type
        return _viol(
            op,
            "mismatch",
            f"expected scalar type {_sc(q.dtype)} but found {_sc(found.dtype)}",
            args,
            kwargs,
            mismatched,
            v.dtype,
        )
    return q.dtype


def _sdpa_overrideable(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _qkv(op, args, kwargs, dev, "scalar") or args[0].dtype


def _fused_weights(
    op: str,
    args: Args,
    kwargs: Kwargs,
    dev: Device,
    x: Tensor,
    layers: Sequence[tuple[Tensor, Tensor | None]],
    norms: Sequence[Tensor | None],
) -> Any:
    # The fused encoder-layer / MHA kernels (transformers/attention.cpp, transformer.cpp) run
    # their projections as mm/addmm in x's dtype, so weights and biases must have x's dtype;
    # measured on CPU, the qkv bias is the exception (added by transform_bias_rescale_qkv, which
    # takes it in any float dtype). Their layer norms follow the device's layer_norm rule (CPU
    # lets a bf16/f16 x use f32 norm weights).
    weights = [w for w, _ in layers]
    if any(w.dtype != x.dtype for w in weights):
        bad = [w for w in weights if w.dtype != x.dtype]
        w0 = bad[0]
        msg = (
            f"expected {'mat1 and mat2' if dev.kernels == 'cuda' else 'm1 and m2'} to have the same dtype, "
            f"but got: {_cpp(x.dtype)} != {_cpp(w0.dtype)}"
            if w0 is weights[0]
            else f"self and mat2 must have the same dtype, but got {_sc(x.dtype)} and {_sc(w0.dtype)}"
        )
        if len(bad) == len(weights) and len({w.dtype for w in bad}) == 1:
            # the whole layer is in another dtype: the activation is the odd one
            return _viol(op, "mismatch", msg, args, kwargs, [x], w0.dtype)
        return _viol(op, "mismatch", msg, args, kwargs, bad, x.dtype)
    # CUDA (measured, H100): the qkv bias must be x's dtype too ("expected scalar type ...")
    qkv_bias = layers[0][1]
    if dev.kernels == "cuda" and qkv_bias is not None and qkv_bias.dtype != x.dtype:
        return _scalar(op, "mismatch", args, kwargs, x.dtype, [qkv_bias])
    bad_b = [b for i, (_, b) in enumerate(layers) if i > 0 and b is not None and b.dtype != x.dtype]
    if bad_b:
        return _viol(
            op,
            "mismatch",
            f"self and mat2 must have the same dtype, but got {_sc(bad_b[0].dtype)} and {_sc(x.dtype)}",
            args,
            kwargs,
            bad_b,
            x.dtype,
        )
    for i in range(0, len(norms), 2):
        v = _norm_params(op, args, kwargs, dev, x, norms[i : i + 2], cuda_mixed=False)
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


def _no_softmax_kernel(op: str, args: Args, kwargs: Kwargs, x: Tensor) -> Violation:
    # softmax's kernels dispatch on floating and complex types only
    return _viol(
        op,
        "unsupported",
        f"\"softmax_lastdim_kernel_impl\" not implemented for '{_sc(x.dtype)}'",
        args,
        kwargs,
        [x],
        F32,
    )


def _softmax(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    x = args[0]
    half_to_float = bool(_arg(args, kwargs, 2, "half_to_float", False))
    if not (_is_float(x.dtype) or x.dtype.is_complex):
        return _no_softmax_kernel(op, args, kwargs, x)
    if half_to_float:
        if dev.kernels == "cpu":
            return _viol(
                op,
                "unsupported",
                "softmax with half to float conversion is not supported on CPU",
                args,
                kwargs,
                [x],
                None,
            )
        if x.dtype != F16:
            return _viol(op, "unsupported", "conversion is supported for Half type only", args, kwargs, [x], F16)
        return F32
    return x.dtype


def _softmax_dtype(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # softmax.int / log_softmax.int / _safe_softmax(self, dim, dtype=None): computes in `dtype`
    x = args[0]
    dtype = _arg(args, kwargs, 2, "dtype")
    if dtype is None and not (_is_float(x.dtype) or x.dtype.is_complex):
        return _no_softmax_kernel(op, args, kwargs, x)
    return dtype if dtype is not None else x.dtype


def _softmax_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    go, out = args[0], args[1]
    input_dtype = _arg(args, kwargs, 3, "input_dtype")
    if dev.kernels == "cuda":
        return _softmax_backward_cuda(op, args, kwargs, go, out, input_dtype)
    if go.dtype != out.dtype:
        return _scalar(op, "mismatch", args, kwargs, go.dtype, [out])
    if input_dtype == F16 and go.dtype == F32:  # CPU measured: the half_to_float backward is refused
        return _viol(op, "unsupported", "expected scalar type Float but found Half", args, kwargs, [go], F16)
    return go.dtype


def _softmax_backward_cuda(op: str, args: Args, kwargs: Kwargs, go: Tensor, out: Tensor, input_dtype: Any) -> Any:
    # cuda/SoftMax.cu (measured, H100): the input dtype is checked first; a grad/output mismatch
    # between the two 16-bit types is reported against the float accumulate type
    if input_dtype is not None and input_dtype != go.dtype and not (go.dtype == F32 and input_dtype == F16):
        msg = "expected input and grad types to match, or input to be at::Half and grad to be at::Float"
        return _viol(op, "mismatch", msg, args, kwargs, [go], input_dtype)
    if go.dtype != out.dtype:
        found = F32 if go.dtype in _REDUCED and out.dtype in _REDUCED else out.dtype
        msg = f"expected scalar type {_sc(go.dtype)} but found {_sc(found)}"
        return _viol(op, "mismatch", msg, args, kwargs, [out], go.dtype)
    return F16 if input_dtype == F16 and go.dtype == F32 else go.dtype


# ---------------------------------------------------------------------------------------------
# embedding and indexing (device-agnostic checks in Embedding.cpp, TensorAdvancedIndexing.cpp,
# ScatterGatherChecks.h, IndexingUtils.h; CPU messages measured)
