"""Fused fast-path ops that fake tensors cannot run, covered on purpose (DESIGN.md #6).

In eval mode under no_grad, ``nn.TransformerEncoder`` packs its input into a nested tensor
(``aten::_nested_tensor_from_mask``) and every layer calls the fused
``aten::_transformer_encoder_layer_fwd``; ``nn.MultiheadAttention`` calls
``aten::_native_multi_head_attention``. Fake tensors support neither nested tensors nor these
kernels, so a fake audit would stop (or pass silently) exactly where story 3 fails.

During a fake audit the tracer runs these ops through :func:`run`: the nested tensor is stood in
for by the dense padded tensor itself (padding changes values, never dtypes), and the fused
kernels get a fake implementation that enforces the real kernel's dtype contract: every floating
operand (weights, biases, norms) must have the input's dtype, because the fused C++ kernel does
no autocast and no promotion. Nothing here is registered globally: it lives only in the
tracer's handler, so it exists only while an audit runs.

RNNs on simulated CUDA: ``nn.LSTM``/``nn.GRU`` ask the CUDA runtime whether cuDNN can run
(which fails on a machine without a GPU), so a fake CUDA audit runs them with cuDNN off, on the
native CUDA path: per-step ``linear`` ops (checked against the table like any op) and a fused
cell. The fused GRU cell has no fake kernel: :func:`run_rnn_cell` stands in for it and
:func:`check_rnn_cell` enforces cuDNN's dtype contract (gates, hidden state and biases in one
dtype), which the native path shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from castwise import _aten as aten
from castwise._dtypes import name_of, short_of
from castwise.trace import datadep
from castwise.trace.contracts import Violation, tensor_args

_MHA = aten.op("_native_multi_head_attention")

# fused kernels: the op, and which positional argument is the activation the weights must match
FUSED: dict[Any, int] = dict.fromkeys(
    aten.overloads(["_transformer_encoder_layer_fwd", "_native_multi_head_attention"]), 0
)
NESTED_FROM_MASK: set[Any] = set(aten.overloads(["_nested_tensor_from_mask"]))
LEFT_ALIGNED: set[Any] = set(aten.overloads(["_nested_tensor_from_mask_left_aligned"]))
TO_PADDED: set[Any] = set(aten.overloads(["to_padded_tensor"]))
# fused RNN cells with no fake kernel: (op, output shapes from the operands)
RNN_CELLS: frozenset[Any] = frozenset(aten.ops(["_thnn_fused_gru_cell", "_thnn_fused_gru_cell_backward"]))
# RNN kernels whose dtype contract is cuDNN's / oneDNN's: every floating operand in one dtype
# (measured on CPU: oneDNN's LSTM cannot build a primitive for f16 input with f32 weights)
RNN_CONTRACT: frozenset[Any] = RNN_CELLS | frozenset(
    aten.ops(["mkldnn_rnn_layer", "_cudnn_rnn", "_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl"])
)
HANDLED: frozenset[Any] = frozenset({*FUSED, *NESTED_FROM_MASK, *LEFT_ALIGNED, *TO_PADDED})


def op_name(func: Any) -> str:
    return f"{func.namespace}.{func._opname}"


def check_fused(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], stand: Stand, autocast: torch.dtype | None
) -> Violation | None:
    """The fused kernel's contract: every floating operand has the activation's dtype, unless
    the input is dense and autocast is on (measured on CPU: the dense kernel's inner ops are then
    autocast; the nested-tensor path's are not)."""
    tensors = tensor_args(args, kwargs)
    first = args[FUSED[func]] if len(args) > FUSED[func] else None
    if not isinstance(first, torch.Tensor) or not first.is_floating_point():
        return None
    nested = first.is_nested or id(first) in stand.ids
    if autocast is not None and not nested:
        return None
    want = first.dtype
    bad = [i for i, t in enumerate(tensors) if t.is_floating_point() and t.dtype != want]
    if not bad:
        return None
    other = tensors[bad[0]].dtype
    # the real CPU kernel words it from the weights' side: it expected their type, found the input's
    message = f"expected scalar type {_scalar(other)} but found {_scalar(want)}"
    # the activation is at fault: the weights are what the model was built with
    index = next(i for i, t in enumerate(tensors) if t is first)
    return Violation(op_name(func), "mismatch", message, (index,), name_of(other))


def _scalar(dtype: torch.dtype) -> str:
    return {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double"}.get(
        dtype, short_of(dtype)
    )


class Stand:
    """Dense tensors that stand in for nested ones during a fake audit."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self._alive: list[torch.Tensor] = []  # so an id is not reused while the run lasts

    def add(self, t: torch.Tensor) -> None:
        self.ids.add(id(t))
        self._alive.append(t)


def left_aligned(keep: torch.Tensor) -> bool:
    """True when every row of a keep-mask is True then False (padding only at the end)."""
    as_int = keep.to(torch.int8)
    return bool((as_int[..., 1:] <= as_int[..., :-1]).all()) if keep.shape[-1] > 1 else True


def run_fake(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], stand: Stand, mask: torch.Tensor | None = None
) -> Any:
    """Run a fast-path op on fake tensors (the caller has checked the contract). ``mask``: the
    real values of the keep-mask, when the tracer knows them."""
    if func in LEFT_ALIGNED:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # a real value, made outside the fake mode, so `not x` works
            # without the mask's values, assume the usual layout (padding at the end)
            return torch.tensor(True if mask is None else left_aligned(mask))
    if func in NESTED_FROM_MASK:
        nested = torch.empty_like(args[0])
        stand.add(nested)
        return nested
    if func in TO_PADDED:
        return args[0]
    src = args[0]
    if func is _MHA:
        query = args[0]
        out = torch.empty_like(query)
        weights = query.new_empty((query.shape[0], query.shape[1], args[1].shape[1])) if query.dim() == 3 else None
        return out, weights
    out = torch.empty_like(src)
    if id(src) in stand.ids:  # nested in, nested out
        stand.add(out)
    return out


def needs_fake_run(func: Any, args: tuple[Any, ...], stand: Stand) -> bool:
    """True when the op must not reach the fake kernel (it would fail or mislead)."""
    if func in TO_PADDED:
        return bool(args) and id(args[0]) in stand.ids
    return func in HANDLED


def check_rnn_cell(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: Any, autocast_cast: bool
) -> Violation | None:
    """cuDNN's (and the fused cell's) RNN contract: every floating operand in one dtype; and for
    oneDNN's CPU LSTM, which 16-bit primitives the ``device`` class has (:func:`_onednn_rnn`).
    ``autocast_cast``: autocast cast the input to its dtype (it was another dtype before)."""
    tensors = tensor_args(args, kwargs)
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    if not floats:
        return None
    want = tensors[floats[0]].dtype
    bad = tuple(i for i in floats if tensors[i].dtype != want)
    if not bad and func._opname == "mkldnn_rnn_layer":
        text = _onednn_rnn(want, device, autocast_cast, torch.is_grad_enabled())
        return None if text is None else Violation(op_name(func), "unsupported", text, tuple(floats), None)
    if not bad:
        return None
    other = tensors[bad[0]].dtype
    message = (
        f"{op_name(func)}: the RNN's input, hidden state and weights must share one dtype, got "
        f"{short_of(want)} and {short_of(other)}"
    )
    return Violation(op_name(func), "mismatch", message, bad, name_of(want))


_NO_PRIMITIVE = "could not create a primitive descriptor for the LSTM forward propagation primitive"


def _onednn_rnn(dtype: torch.dtype, device: Any, autocast_cast: bool, grad: bool) -> str | None:
    """Why oneDNN's CPU LSTM (``mkldnn_rnn_layer``) refuses ``dtype`` on ``device``, or None.

    Measured with real torch 2.14 on a Sapphire Rapids-class Xeon (avx512_fp16, amx_bf16, no
    amx_fp16: ``cpu:amx``) and on its kernels capped to ``cpu:avx512`` / ``cpu:avx2``
    (``ATEN_CPU_CAPABILITY`` + ``ONEDNN_MAX_CPU_ISA``):
    - torch picks oneDNN by the *input's* dtype (aten/src/ATen/native/RNN.cpp ``use_mkldnn``):
      f32 always, bf16/f16 only where the CPU's oneDNN takes them (f16 only under no_grad). Under
      CPU autocast the input is still f32 when torch picks, and autocast casts it for
      ``mkldnn_rnn_layer`` afterwards: the 16-bit oneDNN LSTM is reached whatever the class.
    - a class whose oneDNN lacks the dtype (bf16 on AVX2; f16 on AVX-512 and AVX2) then has no
      primitive, under no_grad too; an input that already had the dtype never gets here there
      (the native kernels run it).
    - the AMX class has bf16 and f16 LSTMs, but its f16 one for inference only: with grad enabled
      (forward training) it has no primitive, under no_grad it runs.
    """
    if dtype not in (torch.float16, torch.bfloat16) or device.kernels == "cuda":
        return None
    short = short_of(dtype)
    if device.path(name_of(dtype)) != "cpu.onednn":
        if not autocast_cast:
            return None
        return f"{_NO_PRIMITIVE} (this CPU's oneDNN has no {short} LSTM; autocast casts its f32 input to {short})"
    if dtype == torch.float16 and grad:
        return f"{_NO_PRIMITIVE} (oneDNN's f16 LSTM on CPU is for inference only: it runs under no_grad)"
    return None


def run_rnn_cell(func: Any, args: tuple[Any, ...]) -> Any:
    """Fake outputs of a fused RNN cell (shapes as the CUDA kernel makes them)."""
    if func._opname == "_thnn_fused_gru_cell":
        hx = args[2]
        return torch.empty_like(hx), hx.new_empty((hx.shape[0], hx.shape[1] * 5))
    grad_hy, _workspace, has_bias = args[0], args[1], args[2]
    batch, hidden = grad_hy.shape[0], grad_hy.shape[1]
    gates = grad_hy.new_empty((batch, 3 * hidden))
    bias = grad_hy.new_empty((3 * hidden,)) if has_bias else None
    return (
        gates,
        grad_hy.new_empty((batch, 3 * hidden)),
        torch.empty_like(grad_hy),
        bias,
        None if bias is None else torch.empty_like(bias),
    )


def run_grouped_mm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Fake output of ``aten._grouped_mm`` (shapes as the real kernels' output tensor). Torch's meta
    kernel refuses f32 (and f16 without cuBLASLt), which both real kernels accept: the contract
    table checks the dtypes (contracts/moe.py), this only makes the result, in ``mat_a``'s dtype."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise RuntimeError("mat_a has to be 2 or 3d" if a.dim() not in (2, 3) else "mat_b has to be 2 or 3d")
    if (a.dim() == 3 or b.dim() == 3) and a.shape[-1] != b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if a.dim() == 2 and b.dim() == 2:
        groups = offs.shape[0] if offs is not None else 0
        shape: tuple[Any, ...] = (groups, a.shape[0], b.shape[1])
    elif a.dim() == 2:
        shape = (a.shape[0], b.shape[-1])
    elif b.dim() == 2:
        shape = (a.shape[1], b.shape[1])
    else:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    return a.new_empty(shape, dtype=out_dtype)


# ops whose fake kernel is missing or stricter than the real one: castwise's fake implementation
# runs instead during a fake audit (the contract table still checks them first)
OWN_FAKE: dict[Any, Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]] = {
    **{op: lambda _values, func, args, _kwargs: run_rnn_cell(func, args) for op in RNN_CELLS},
    **dict.fromkeys(aten.ops(["_grouped_mm"]), lambda _values, func, args, kwargs: run_grouped_mm(func, args, kwargs)),
    **datadep.OWN_FAKE,  # sizes from values: x[mask], nonzero, unique...
}
