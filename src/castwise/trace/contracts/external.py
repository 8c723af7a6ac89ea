"""Contracts for kernels called outside aten: what each package's own checks refuse.

Keyed by the op name the package registers with the dispatcher (``flash_attn._flash_attn_forward``
for ``torch.library.custom_op("flash_attn::_flash_attn_forward", ...)``), so a contract applies when
the package is installed and when a model registers an op of the same name (castwise never imports
the package). Each rule cites the check it follows: the file in the package's repository, the
check, and the release it was read from. The kernels are CUDA kernels: on another device family
the rules make no claim (the op is covered, its own fake kernel says what it returns).

Packages whose kernels are not dispatcher ops (Liger's Triton autograd Functions, apex's and
grouped_gemm's pybind extensions, TransformerEngine's modules) never reach the tracer as an op:
there is nothing to key a contract on, and they are left out here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from castwise.devices import Device
from castwise.trace.contracts._base import (
    BF16,
    F16,
    F32,
    I32,
    Args,
    Kwargs,
    Rule,
    Tensor,
    Violation,
    _arg,
    _viol,
)

__all__ = ["EXTERNAL", "mixed_width"]

_HALF = (F16, BF16)
_FP8_E4M3 = getattr(torch, "float8_e4m3fn", None)


def _qkv(args: Args, kwargs: Kwargs, names: Sequence[str] = ("q", "k", "v")) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(names))
    return q, k, v


def _flash_like(
    op: str, args: Args, kwargs: Kwargs, accepted: tuple[torch.dtype | None, ...], dtype_msg: str, max_head: int
) -> Any:
    """FlashAttention's forward checks, in the kernel's order: q's dtype, then k and v against q,
    then the head size (csrc/flash_attn/flash_api.cpp ``mha_fwd``, hopper/flash_api.cpp)."""
    q, k, v = _qkv(args, kwargs)
    if q.dtype not in accepted:
        # beside a 16-bit k or v, an f32 q is a missed cast (a norm autocast ran in f32): a
        # mismatch, whose fix is that 16-bit dtype; all-f32 operands have no kernel at all
        half = [t.dtype for t in (v, k) if t.dtype in _HALF]
        kind = "mismatch" if half else "unsupported"
        odd = [t for t in (q, k, v) if t.dtype not in _HALF] if half else [q]
        return _viol(op, kind, dtype_msg, args, kwargs, odd, half[0] if half else BF16)
    for t, name in ((k, "key"), (v, "value")):
        if t.dtype != q.dtype:
            # the odd one is the operand off the 16-bit dtype: q when it is f32 (ruled out above)
            return _viol(op, "mismatch", f"query and {name} must have the same dtype", args, kwargs, [t], q.dtype)
    head = q.shape[-1]
    if isinstance(head, int) and head > max_head:
        msg = f"FlashAttention forward only supports head dimension at most {max_head}"
        return _viol(op, "unsupported", msg, args, kwargs, [q], None)
    return q.dtype


def _on_cuda(rule: Rule) -> Rule:
    """The package's kernels are CUDA kernels: elsewhere, no claim."""

    def on_cuda(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
        if dev.kernels != "cuda":
            return None
        return rule(op, args, kwargs, dev)

    on_cuda.__name__ = getattr(rule, "__name__", "rule")
    return on_cuda


# -- flash-attn 2 -------------------------------------------------------------------------------
# Dao-AILab/flash-attention v2.7-2.8, csrc/flash_attn/flash_api.cpp mha_fwd / mha_varlen_fwd /
# mha_bwd: TORCH_CHECK(q_dtype == kFloat16 || q_dtype == kBFloat16, "FlashAttention only support
# fp16 and bf16 data type"); TORCH_CHECK(k.dtype() == q_dtype, "query and key must have the same
# dtype") and the same for value; TORCH_CHECK(head_size <= 256, "FlashAttention forward only
# supports head dimension at most 256"). flash_attn/flash_attn_interface.py registers them as
# torch.library.custom_op("flash_attn::_flash_attn_forward" / "_flash_attn_varlen_forward" /
# "_flash_attn_backward" / "_flash_attn_varlen_backward"); flash_attn_func and friends call them.
_FA2_MSG = "FlashAttention only support fp16 and bf16 data type"


def _fa2_forward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _flash_like(op, args, kwargs, _HALF, _FA2_MSG, 256)


def _fa2_backward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    # mha_bwd(dout, q, k, v, out, softmax_lse, ...): the same dtype checks on q/k/v, then
    # TORCH_CHECK(out.dtype() == q_dtype, "query and out must have the same dtype") and dout's
    dout, q, k, v, out = (_arg(args, kwargs, i, n) for i, n in enumerate(("dout", "q", "k", "v", "out")))
    found = _flash_like(op, (q, k, v), {}, _HALF, _FA2_MSG, 256)
    if isinstance(found, Violation):
        return _viol(op, found.kind, found.message, args, kwargs, _culprits(found, (q, k, v)), q.dtype)
    for t, name in ((out, "out"), (dout, "dout")):
        if isinstance(t, torch.Tensor) and t.dtype != q.dtype:
            return _viol(op, "mismatch", f"query and {name} must have the same dtype", args, kwargs, [t], q.dtype)
    return q.dtype


def _culprits(found: Violation, tensors: Sequence[Tensor]) -> list[Tensor]:
    return [tensors[i] for i in found.culprits if i < len(tensors)]


# -- flash-attn 3 (hopper) ----------------------------------------------------------------------
# Dao-AILab/flash-attention hopper/flash_api.cpp mha_fwd (FA3 beta, 2025): TORCH_CHECK(q_type ==
# Half || BFloat16 || Float8_e4m3fn, "FlashAttention only supports fp16, bf16, and fp8_e4m3 data
# type"); "query and key must have the same dtype" / "query and value ..."; head dim at most 256.
# Registered by TORCH_LIBRARY(flash_attn_3, m) as fwd / bwd (torch.ops.flash_attn_3.fwd).
_FA3_MSG = "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type"


def _fa3_forward(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _flash_like(op, args, kwargs, (*_HALF, _FP8_E4M3), _FA3_MSG, 256)


# -- xFormers -----------------------------------------------------------------------------------
# facebookresearch/xformers 0.0.2x, xformers/ops/fmha/common.py Inputs.validate_inputs: raise
# ValueError("Query/Key/Value should all have the same dtype ...") before any kernel; the kernels'
# SUPPORTED_DTYPES: cutlass.py {float, half, bfloat16} (xformers::efficient_attention_forward_cutlass),
# flash.py {half, bfloat16} (xformers_flash::flash_fwd).


def _xformers(accepted: tuple[torch.dtype, ...]) -> Rule:
    def rule(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
        q, k, v = _qkv(args, kwargs, ("query", "key", "value"))
        if not (q.dtype == k.dtype == v.dtype):
            odd = [t for t in (q, k) if t.dtype != v.dtype]
            msg = (
                "Query/Key/Value should all have the same dtype\n"
                f"  query.dtype: {q.dtype}\n  key.dtype  : {k.dtype}\n  value.dtype: {v.dtype}"
            )
            return _viol(op, "mismatch", msg, args, kwargs, odd, v.dtype)
        if q.dtype not in accepted:
            names = ", ".join(sorted(str(d) for d in accepted))
            msg = f"No operator found for `memory_efficient_attention_forward`: dtype={q.dtype} (supported: {names})"
            return _viol(op, "unsupported", msg, args, kwargs, [q, k, v], BF16)
        return q.dtype

    return rule


# -- SageAttention ------------------------------------------------------------------------------
# thu-ml/SageAttention 2.x, sageattention/core.py sageattn_qk_int8_pv_fp16_triton / _cuda /
# _fp8_cuda / sageattn_varlen: assert dtype in [torch.float16, torch.bfloat16], "Input tensors must
# be in dtype of torch.float16 or torch.bfloat16"; assert q.dtype == k.dtype == v.dtype, "All
# tensors must have the same dtype.". The checks are Python asserts before the int8 kernels
# (sageattention::qk_int8_sv_f16_accum_*_attn take quantized q/k), so they are keyed by the
# function names a model registers as ops.


def _sage(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    q, k, v = _qkv(args, kwargs)
    if q.dtype not in _HALF:
        half = [t.dtype for t in (v, k) if t.dtype in _HALF]
        msg = "Input tensors must be in dtype of torch.float16 or torch.bfloat16"
        odd = [t for t in (q, k, v) if t.dtype not in _HALF] if half else [q]
        return _viol(op, "mismatch" if half else "unsupported", msg, args, kwargs, odd, half[0] if half else BF16)
    if not (q.dtype == k.dtype == v.dtype):
        odd = [t for t in (k, v) if t.dtype != q.dtype]
        return _viol(op, "mismatch", "All tensors must have the same dtype.", args, kwargs, odd, q.dtype)
    return q.dtype


# -- bitsandbytes -------------------------------------------------------------------------------
# bitsandbytes-foundation/bitsandbytes 0.46+, bitsandbytes/_ops.py (torch.library.define and the
# register_fake checks): int8_linear_matmul torch._check(A.dtype == torch.int8, "A must be int8")
# and B, returns int32; int8_mm_dequant "A must be int32", returns dtype or float16;
# int8_vectorwise_dequant "A must be int8", returns float32; gemv_4bit "A must be float16,
# bfloat16, or float32", returns A's dtype; dequantize_4bit / dequantize_blockwise return ``dtype``
# (dequantize_blockwise: "A must be uint8").


def _must(op: str, args: Args, kwargs: Kwargs, name: str, i: int, want: tuple[torch.dtype, ...], msg: str) -> Any:
    t = _arg(args, kwargs, i, name)
    if isinstance(t, torch.Tensor) and t.dtype not in want:
        return _viol(op, "unsupported", msg.format(t.dtype), args, kwargs, [t], want[0])
    return None


def _bnb_int8_matmul(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    for i, name in enumerate(("A", "B")):
        bad = _must(op, args, kwargs, name, i, (torch.int8,), f"{name} must be int8")
        if bad:
            return bad
    return I32


def _bnb_mm_dequant(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    bad = _must(op, args, kwargs, "A", 0, (I32,), "A must be int32")
    return bad or _arg(args, kwargs, 3, "dtype") or F16


def _bnb_vectorwise_dequant(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    return _must(op, args, kwargs, "A", 0, (torch.int8,), "A must be int8") or F32


def _bnb_gemv_4bit(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
    msg = "A must be float16, bfloat16, or float32, got {}"
    return _must(op, args, kwargs, "A", 0, (BF16, F16, F32), msg) or _arg(args, kwargs, 0, "A").dtype


def _bnb_dequantize(dtype_at: int, name: str = "dtype", uint8: bool = False) -> Rule:
    def rule(op: str, args: Args, kwargs: Kwargs, dev: Device) -> Any:
        bad = _must(op, args, kwargs, "A", 0, (torch.uint8,), "A must be uint8, got {}") if uint8 else None
        return bad or _arg(args, kwargs, dtype_at, name)

    return rule


# op name (namespace.opname, as the dispatcher spells it) -> rule
EXTERNAL: dict[str, Rule] = {
    **dict.fromkeys(
        (
            "flash_attn._flash_attn_forward",
            "flash_attn._flash_attn_varlen_forward",
            "flash_attn.flash_attn_func",
            "flash_attn.flash_attn_varlen_func",
        ),
        _on_cuda(_fa2_forward),
    ),
    **dict.fromkeys(
        ("flash_attn._flash_attn_backward", "flash_attn._flash_attn_varlen_backward"), _on_cuda(_fa2_backward)
    ),
    **dict.fromkeys(("flash_attn_3.fwd", "flash_attn_3.flash_attn_func"), _on_cuda(_fa3_forward)),
    "xformers.efficient_attention_forward_cutlass": _on_cuda(_xformers((F32, F16, BF16))),
    "xformers_flash.flash_fwd": _on_cuda(_xformers(_HALF)),
    "xformers.memory_efficient_attention": _on_cuda(_xformers((F32, F16, BF16))),
    **dict.fromkeys(
        (
            "sageattention.sageattn",
            "sageattention.sageattn_varlen",
            "sageattention.sageattn_qk_int8_pv_fp16_triton",
            "sageattention.sageattn_qk_int8_pv_fp16_cuda",
            "sageattention.sageattn_qk_int8_pv_fp8_cuda",
        ),
        _on_cuda(_sage),
    ),
    # bitsandbytes registers CPU, CUDA and XPU kernels behind the same fake checks
    "bitsandbytes.int8_linear_matmul": _bnb_int8_matmul,
    "bitsandbytes.int8_mm_dequant": _bnb_mm_dequant,
    "bitsandbytes.int8_vectorwise_dequant": _bnb_vectorwise_dequant,
    "bitsandbytes.gemv_4bit": _bnb_gemv_4bit,
    "bitsandbytes.dequantize_4bit": _bnb_dequantize(5),
    "bitsandbytes.dequantize_blockwise": _bnb_dequantize(4, uint8=True),
}


# -- mixed widths into an op without a contract (CW160) --------------------------------------------

# namespaces whose ops are torch's own: their meta kernels compute dtypes as the real ones do, and
# the family tables above cover the ones that refuse
_TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "profiler", "higher_order"})
_NARROW = frozenset({F16, BF16})
_WIDE = frozenset({F32, torch.float64})
# origins that are meant to stay wide beside 16-bit activations (a norm's f32 weight, a scale)
_HELD = frozenset({"param", "buffer", "attribute"})


def mixed_width(
    name: str, module: str, phase: str, tensors: Sequence[Tensor], prov_of: Callable[[Tensor], Any]
) -> dict[str, Any] | None:
    """An op outside torch receives floating activations of different widths (f32 beside bf16/f16):
    what CW160 reads, as plain values, or None.

    Activations are floating tensors of two or more dims not held by a module (parameters and
    buffers, such as a fused norm's f32 weight, are the kernel's to take as they are). The odd ones
    are the wide activations of the same rank as a 16-bit one (q/k beside v): a per-row scale or a
    rotary table of another rank is a different role, not a missed cast.
    """
    if name.partition(".")[0] in _TORCH_NAMESPACES:
        return None
    acts = [(i, t) for i, t in enumerate(tensors) if t.is_floating_point() and t.dim() >= 2]
    narrow_ranks = {t.dim() for _, t in acts if t.dtype in _NARROW}
    if not narrow_ranks:
        return None
    odd = []
    for i, t in acts:
        if t.dtype not in _WIDE or t.dim() not in narrow_ranks:
            continue
        prov = prov_of(t)
        if prov is not None and prov.kind in _HELD:
            continue
        odd.append(
            {
                "index": i,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": tuple(int(s) if isinstance(s, int) else -1 for s in t.shape),
                "kind": prov.kind if prov is not None else None,
                "origin": prov.origin() if prov is not None else None,
                "op": prov.op if prov is not None else None,
                "describe": prov.describe() if prov is not None else None,
                "source": prov.source if prov is not None else None,
            }
        )
    if not odd:
        return None
    narrow = next(t.dtype for _, t in acts if t.dtype in _NARROW)
    return {
        "op": name,
        "module": module,
        "phase": phase,
        "narrow": str(narrow).removeprefix("torch."),
        "dtypes": tuple(str(t.dtype).removeprefix("torch.") for _, t in acts),
        "odd": tuple(odd),
    }
