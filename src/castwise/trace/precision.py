"""The precision observer: where values are computed narrower than intended, which nothing raises.

It records (``trace.observed["precision"]``, values of ``castwise.rules.audit._precision``):

- up-cast containment (CW120): the float32 a module returns in a 16-bit model, followed through
  scalar and view ops to what consumes it. Fed only to a loss, a softmax, a norm or a reduction
  (``logits.float()`` before cross-entropy) it is *contained*; reaching a matmul or mixing into a
  16-bit stream it *spreads*.
- 16-bit ops autocast would run in float32 (CW140), outside autocast. Whether autocast runs an op
  in float32 on the target is asked of torch itself (the op run once under that device's autocast
  on fake tensors, cached), never read from a list of our own.
- positions (a position grid, a running count, position ids, a timestep) rounded to 16-bit where
  their spacing is 2 or more, then multiplied with a frequency table into the phases a sin, cos,
  exp or polar reads (CW141); and decisions on 16-bit probabilities (CW142).
- 16-bit accumulators added into over many contributions (CW143, ``trace/accumulation.py``).

Keep ``after`` cheap: it runs for every op. Its records are per origin chain (blocks generalize),
so a block reuse splice standing for a block's ops loses nothing the rules need (``splices``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from castwise import _autocast
from castwise._dtypes import LOW, name_of
from castwise.rules.audit._precision import (
    LOGITS,
    NAME,
    Decision,
    LowOp,
    Narrowed,
    PrecisionRecord,
    Rounding,
    spacing,
)
from castwise.trace import accumulation, fake, simcuda
from castwise.trace.attribution import tensors_of
from castwise.trace.observers import Observer, OpCall

if TYPE_CHECKING:
    from castwise.trace.events import Frame, Prov, Trace
    from castwise.trace.observers import Run

_LOW_DTYPES = (torch.bfloat16, torch.float16)
_Probe = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# ops whose 16-bit result is a real loss when autocast would have run them in float32: a loss or
# log-probabilities, whose values (|log p| ~ ln(classes)) are kept rounded to the 16-bit spacing at
# their magnitude. Each maps to the public call torch's autocast policy is asked about.
# Left out on purpose (their kernels compute in float32 and round once, as good as float32 then a
# cast): softmax (aten/src/ATen/native/cuda/SoftMax.cu, accscalar_t; CPU vec_softmax in float),
# layer_norm / group_norm (cuda/layer_norm_kernel.cu and group_norm_kernel.cu, acc_type), sum and
# mean (cuda/ReduceSumProdKernel.cu: sum_functor accumulates bf16/f16 in float), pointwise exp /
# log / pow / rsqrt (cuda/UnaryOpsKernel.cu and c10/util/OpMathType.h: opmath_t is float).
_LOSS_PROBES: dict[str, _Probe] = {
    "aten._log_softmax": lambda x, t: torch.log_softmax(x, -1),
    "aten.nll_loss_forward": lambda x, t: F.nll_loss(x, t),
    "aten.nll_loss2d_forward": lambda x, t: F.nll_loss(x[:, :, None, None], t[:, None, None]),
    "aten.logsumexp": lambda x, t: torch.logsumexp(x, -1),
    "aten.mse_loss": lambda x, t: F.mse_loss(x, x),
    "aten.smooth_l1_loss": lambda x, t: F.smooth_l1_loss(x, x),
    "aten.huber_loss": lambda x, t: F.huber_loss(x, x),
    "aten.binary_cross_entropy_with_logits": lambda x, t: F.binary_cross_entropy_with_logits(x, x),
}
# where the float32 of an up-cast ends (CW120): losses, softmax, norms, reductions, decisions
_SINKS = frozenset(
    {
        *_LOSS_PROBES,
        "aten._softmax",
        "aten.l1_loss",
        "aten.kl_div",
        "aten.binary_cross_entropy",
        "aten.sum",
        "aten.mean",
        "aten.amax",
        "aten.amin",
        "aten.max",
        "aten.min",
        "aten.var",
        "aten.var_mean",
        "aten.std",
        "aten.std_mean",
        "aten.norm",
        "aten.linalg_vector_norm",
        "aten.native_layer_norm",
        "aten.native_group_norm",
        "aten._fused_rms_norm",
        "aten.native_batch_norm",
        "aten._native_batch_norm_legit",
        "aten._native_batch_norm_legit_no_training",
        "aten.topk",
        "aten.sort",
        "aten.argmax",
        "aten.argmin",
        "aten.cumsum",
        "aten.prod",
    }
)
# ops that carry values along without mixing them with others (beyond pointwise and views)
_CARRY = frozenset(
    {"aten.clone", "aten.gather", "aten.index_select", "aten.index", "aten.cat", "aten.stack", "aten.where"}
)


# a decision taken on values: which experts, which token, which order (CW142)
_DECISIONS = frozenset(
    {"aten.topk", "aten.argmax", "aten.argmin", "aten.sort", "aten.gt", "aten.lt", "aten.ge", "aten.le", "aten.max"}
)
_ADDED_BUFFER = "an added 16-bit buffer"
# what makes router probabilities, by the name a finding gives it
_PROBS = {"aten._softmax": "softmax", "aten.sigmoid": "sigmoid"}
# what makes router logits (a gate's matmul): top-k taken on them in 16-bit is a choice too (litgpt's
# Mixtral router: topk on the logits, softmax of the k chosen). Measured (bf16 gates of 8 to 128
# experts, 16384 tokens, against the same product in float32): 0.17-2.6% of tokens get another
# expert set, as often as top-k on bf16 probabilities (0.4-1.9%)
_LOGITS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})


# CW141: where positions start (a grid made in forward, a running count) and the casts that may round them
_GRIDS = frozenset({"aten.arange", "aten.cumsum"})
_CASTS = frozenset({"aten._to_copy", "aten.to", "aten.type_as", "aten._autocast_to_reduced_precision"})
# the ops turning positions into phases with a frequency table (outer, einsum and matmul reach aten
# as mul, mm or bmm), and what reads a phase
_PHASE_OPS = frozenset({"aten.mul", "aten.mm", "aten.bmm", "aten.matmul", "aten.outer", "aten.einsum"})
_PHASE_READS = frozenset({"aten.sin", "aten.cos", "aten.exp", "aten.polar"})
# positions are rounded where neighbouring 16-bit values are this far apart (bf16 from 256, f16 from 2048)
_ROUNDS_AT = 2.0
_EXACT = Rounding(None, "", torch.float32, None, 0.0)  # positions not rounded (a marker)
_PLAIN = Rounding(None, "", torch.float32, None, -1.0)  # an input that is no positions (asked once)


@functools.cache
def autocast_f32(op: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``device_type``'s autocast at ``dtype`` runs ``op``'s public call in float32: asked
    of torch, on fake tensors (once per op, device type and dtype)."""
    probe = _LOSS_PROBES.get(op)
    if probe is None:
        return False
    with _disable_current_modes(), simcuda.host_device_init():
        mode = fake.new_mode()
        with mode:
            x = torch.empty(4, 8, dtype=dtype, device=device_type)
            t = torch.zeros(4, dtype=torch.long, device=device_type)
            with _autocast.autocast(device_type, dtype):
                out = probe(x, t)
    return bool(out.dtype == torch.float32)


@functools.cache
def _pointwise(func: Any) -> bool:
    return torch.Tag.pointwise in getattr(func, "tags", ())


def _made_by(call: OpCall, x: torch.Tensor) -> str | None:
    """The module whose op computed ``x``'s values, back through the ops that only carry them (a
    view, ``log_softmax``, a division by a temperature): the head made a loss's logits, not the
    loss. Provenance says where the dtype came from (the first 16-bit weight upstream); the fix
    belongs to the module that made the 16-bit values. The autograd graph (train) is walked while
    each node has one input; in eval, views are followed to their base."""
    node: Any = x.grad_fn
    for _ in range(32):
        if node is None:
            break
        inputs = [f for f, _ in node.next_functions if f is not None]
        if len(inputs) != 1:
            made = node.metadata.get("castwise")
            if made is not None:
                return str(made)
            break
        node = inputs[0]
    t = x
    while t._is_view() and t._base is not None:
        t = t._base
    found: str | None = call.run.at.creator.get(t)
    return found


def _is_low(t: torch.Tensor) -> bool:
    return name_of(t.dtype) in LOW


def _kind(call: OpCall, t: torch.Tensor) -> str | None:
    prov = call.prov_of(t)
    return prov.kind if prov is not None else None


def _magnitude(op: str, x: torch.Tensor, dim: Any = None) -> float:
    """The size of what a loss-like op makes, from the shape alone: log-probabilities and
    cross-entropy are about ln(classes) (at initialisation, and for the tokens a model gets wrong).
    ``dim``: the op's own class axis (softmax's, logsumexp's), where it names one."""
    if x.dim() == 0:
        return 1.0
    if isinstance(dim, list | tuple) and len(dim) == 1:
        dim = dim[0]
    if isinstance(dim, int) and -x.dim() <= dim < x.dim():
        classes = x.shape[dim]
    else:
        classes = x.shape[1] if op.startswith("aten.nll_loss") and x.dim() >= 2 else x.shape[-1]
    return max(math.log(max(int(classes), 2)), 1.0) if "softmax" in op or "nll" in op or "logsumexp" in op else 1.0


def _class_dim(op: str, args: Any) -> Any:
    """The axis softmax / log_softmax / logsumexp reduce over (their second argument), else None."""
    return args[1] if ("softmax" in op or "logsumexp" in op) and len(args) > 1 else None


def _largest(call: OpCall, t: torch.Tensor) -> float | None:
    """The largest |value| of ``t`` where the run knows its values (inputs, ids, positions); None
    where they hold NaN / inf (uninitialised memory, a buffer no op wrote): no size to read."""
    v = call.run.values.known(t, assume=False)
    if v is None or v.numel() == 0:
        return None
    with _disable_current_modes():
        largest = float(v.detach().double().abs().max())
    return largest if math.isfinite(largest) else None


def _grid_size(call: OpCall, src: torch.Tensor | None, out: torch.Tensor) -> float:
    """How large positions get: known values (a running count summed in float64, not in the 16-bit
    it ran in), else the length of the positions axis."""
    dim = int(call.args[1]) if call.info.name == "aten.cumsum" and len(call.args) > 1 else -1
    if call.info.name == "aten.arange":
        exact = _arange_largest(call.args)
        if exact is not None:  # the positions it means, not their 16-bit values (1023 is bf16 1024)
            return exact
    if src is not None and call.info.name == "aten.cumsum":
        v = call.run.values.known(src, assume=False)
        if v is not None and v.numel():
            with _disable_current_modes():
                summed = float(v.detach().double().cumsum(dim).abs().max())
            if math.isfinite(summed):
                return summed
    if src is not None:
        known = _largest(call, src)
        if known is not None:
            return known
    known = _largest(call, out)
    if known is not None:
        return known
    if not out.dim():
        return 1.0
    # a running count of n ones reaches n; positions along an axis of n (an arange) reach n - 1
    n = float(out.shape[dim])
    return n if call.info.name == "aten.cumsum" else max(n - 1.0, 1.0)


def _arange_largest(args: tuple[Any, ...]) -> float | None:
    """The largest |value| ``arange(end)`` / ``arange(start, end[, step])`` means, computed exactly."""
    numbers: list[float] = []
    for a in args[:3]:
        if not isinstance(a, int | float) or isinstance(a, bool):
            break
        numbers.append(float(a))
    if not numbers:
        return None
    start, end, step = (0.0, numbers[0], 1.0) if len(numbers) == 1 else (numbers[0], numbers[1], 1.0)
    if len(numbers) == 3:
        step = numbers[2]
    count = math.ceil((end - start) / step) if step else 0
    if count <= 0:
        return None
    return max(abs(start), abs(start + step * (count - 1)))


def _rounds(mark: Rounding | None) -> bool:
    """Whether ``mark`` is positions rounded to a step neighbouring positions share."""
    return mark is not None and mark.magnitude > 0 and mark.step >= _ROUNDS_AT


def _unrounded(mark: Rounding | None) -> bool:
    """Positions not (yet) rounded to such a step: exact, or rounded finer than it (a pending mark)."""
    return mark is _EXACT or (mark is not None and mark.magnitude > 0 and not _rounds(mark))


def _scaled(mark: Rounding, op: str, args: tuple[Any, ...], low: bool) -> Rounding:
    """``mark`` after positions are multiplied (divided) by a constant: a rounding's step scales
    with them, and a product made in 16-bit (``low``) is rounded again at its own size. Exact
    positions stay exact (a later cast rounds them at their new size)."""
    if mark is _EXACT or op not in ("aten.mul", "aten.div"):
        return mark
    number = next((a for a in args if isinstance(a, int | float) and not isinstance(a, bool)), None)
    if number is None or number == 0 or not math.isfinite(number):
        return mark
    factor = abs(float(number)) if op == "aten.mul" else 1.0 / abs(float(number))
    return dataclasses.replace(mark, scale=mark.scale * factor, again=mark.again or low)


class _Positions:
    """Follows positions to the phases they make (CW141).

    Positions are integer tensors, the model's floating inputs whose values are known, and grids
    made in forward (arange, cumsum), carried on by views, casts and pointwise ops that mix in
    nothing else (an activation or a weight ends them). They are *rounded* where they become 16-bit
    at a magnitude whose 16-bit spacing is ``_ROUNDS_AT`` or more: an input the engine cast, a cast
    in the model's code (``type_as`` a 16-bit buffer), a grid computed in 16-bit. Rounded positions
    multiplied with a table make a phase; a sin/cos/exp/polar reading it is recorded."""

    def __init__(self) -> None:
        self.marks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> Rounding (or _EXACT)
        self.phases: WeakIdKeyDictionary = WeakIdKeyDictionary()  # phase tensor -> (op, module, Rounding)
        self.found: dict[tuple[str, str, str], Narrowed] = {}
        # a model input cast at the top level (the engine's input cast): its cast names the input
        self.inputs: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def mark_of(self, call: OpCall, t: torch.Tensor) -> Rounding | None:
        found: Rounding | None = self.marks.get(t)  # type: ignore[no-untyped-call]
        if found is not None:
            return None if found is _PLAIN else found
        if not t.is_floating_point():
            return _EXACT if not t.is_complex() else None
        prov = call.prov_of(t)
        if prov is None or prov.kind != "input":
            return None
        size = _largest(call, t)  # an input whose values nobody knows is taken for an activation
        if size is None:
            self.marks[t] = _PLAIN
            return None
        # the engine's input cast rounded it: to a step that matters now, or once the model scales
        # it (a timestep in [0, 1] times 1000); an input left wide is exact
        found = Rounding(None, "", t.dtype, prov, size) if _is_low(t) else _EXACT
        self.marks[t] = found
        return found

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        name = call.info.name
        phase = next((self.phases[t] for t in call.tensors if t in self.phases), None)
        if phase is not None:
            self._phase(call, name, phase, outputs)
            return
        if name == "aten.arange":
            self._mark(call, outputs, _EXACT, None)
            return
        marks: list[Rounding] = []
        others = 0  # operands that carry no positions (a weight, an activation, a table)
        for t in call.tensors:
            m = self.mark_of(call, t)
            if m is None:
                others += t.is_floating_point()
            else:
                marks.append(m)
        if not marks:
            return
        rounded = next((m for m in marks if _rounds(m)), None)
        if name in _PHASE_OPS and (others or len(marks) > 1) and all(t.numel() > 1 for t in call.tensors):
            made = rounded or self._computed(call, outputs)
            if made is not None:
                for o in outputs:
                    if o.is_floating_point():
                        self.phases[o] = (name, call.module, made)
                return
        if others:
            return
        if call.info.is_view or name in _CARRY or name in _CASTS or name in _GRIDS or _pointwise(call.func):
            mark = rounded or next((m for m in marks if m is not _EXACT), _EXACT)
            low = any(o.is_floating_point() and _is_low(o) for o in outputs)
            self._mark(call, outputs, _scaled(mark, name, call.args, low), next(iter(call.tensors), None))

    def _mark(self, call: OpCall, outputs: list[torch.Tensor], mark: Rounding, src: torch.Tensor | None) -> None:
        name = call.info.name
        given = call.prov_of(src) if src is not None and name in _CASTS and not call.module else None
        if given is not None and given.kind == "input":
            for o in outputs:
                self.inputs[o] = dataclasses.replace(given, dtype=o.dtype)
        for o in outputs:
            if _unrounded(mark) and o.is_floating_point() and _is_low(o) and (name in _CASTS or name in _GRIDS):
                # rounded: to a step that matters now, or once the model scales them (pending)
                self.marks[o] = self._rounding(call, name, src, o, _grid_size(call, src, o))
                continue
            self.marks[o] = mark

    def _rounding(self, call: OpCall, name: str, src: torch.Tensor | None, out: torch.Tensor, size: float) -> Rounding:
        if name in _CASTS:  # a cast in the model's code: its own line
            return Rounding(None, call.module, out.dtype, self.prov(call, out), size)
        # computed in 16-bit: the operand that made it so (the engine's input cast of a mask)
        low = src if src is not None and src.is_floating_point() and _is_low(src) else out
        return Rounding(name, call.module, out.dtype, self.prov(call, low), size)

    def prov(self, call: OpCall, t: torch.Tensor) -> Prov | None:
        found: Prov | None = self.inputs.get(t)  # type: ignore[no-untyped-call]
        return found if found is not None else call.prov_of(t)

    def _computed(self, call: OpCall, outputs: list[torch.Tensor]) -> Rounding | None:
        """Exact positions times a 16-bit table, the phase computed in 16-bit (int64 x bf16 is bf16)."""
        out = next((o for o in outputs if o.is_floating_point() and _is_low(o)), None)
        pos = next((t for t in call.tensors if _unrounded(self.marks.get(t))), None)  # type: ignore[no-untyped-call]
        if out is None or pos is None:
            return None
        size = _largest(call, pos)
        if size is None or spacing(size, out.dtype) < _ROUNDS_AT:
            return None
        low = next((t for t in call.tensors if t.is_floating_point() and _is_low(t)), out)
        return Rounding(call.info.name, call.module, out.dtype, self.prov(call, low), size)

    def _phase(self, call: OpCall, name: str, phase: tuple[str, str, Rounding], outputs: list[torch.Tensor]) -> None:
        op, module, rounding = phase
        if name in _PHASE_READS:
            key = (op, module, name)
            if key not in self.found:
                self.found[key] = Narrowed(op, module, name, rounding)
            return
        if call.info.is_view or name in _CARRY or name in _CASTS or _pointwise(call.func):
            for o in outputs:
                if o.is_floating_point():
                    self.phases[o] = phase


class PrecisionObserver(Observer):
    """Records silent precision loss (see the module's docstring)."""

    name = NAME
    splices = True

    def __init__(self) -> None:
        self._reset()
        self.f32_ops: dict[torch.dtype, frozenset[str]] = {}

    def _reset(self) -> None:
        self.marks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # f32 tensor -> up-cast modules it came from
        self.contained: set[str] = set()
        self.spread: set[str] = set()
        self.low_ops: dict[tuple[str, str], LowOp] = {}
        self.decisions: dict[tuple[str, str], Decision] = {}
        self.probs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # probabilities -> what made them
        self.logits: WeakIdKeyDictionary = WeakIdKeyDictionary()  # 16-bit matmul outputs (and their views)
        # scores that hold a rounded 16-bit buffer (an expert bias) -> its dtype, whatever their own
        self.rounded: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.positions = _Positions()
        self.accumulations = accumulation.Accumulations()

    def start(self, run: Run) -> None:
        self._reset()
        # asked before the run: inside an op the dispatcher excludes the autocast keys
        dt = run.device.autocast_type
        self.f32_ops = {d: frozenset(op for op in _LOSS_PROBES if autocast_f32(op, dt, d)) for d in _LOW_DTYPES}

    def module_exit(self, run: Run, frame: Frame, output: Any) -> None:
        self.accumulations.module_exit(frame, output)
        # the same test as the up-cast observer's: a module given 16-bit activations returning f32
        if frame.autocast is not None or not frame.name:
            return
        ins = [t for t in frame.inputs if t.is_floating_point()]
        if not ins or not all(_is_low(t) for t in ins):
            return
        for t in tensors_of(output):
            if t.dtype == torch.float32:
                self.marks[t] = (*self.marks.get(t, ()), frame.name)  # type: ignore[no-untyped-call]

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        if call.phase != "forward":
            return
        if self.marks:
            self._follow(call, outputs)
        name = call.info.name
        if name in _LOSS_PROBES and call.autocast is None:
            self._low_op(call, name, outputs)
        if name in _PROBS or self.probs or name == "aten.add":
            self._decide(call, name, outputs)
        if name in _LOGITS or self.logits:
            self._logits(call, name, outputs)
        self.positions.after(call, outputs)
        if name in accumulation.OPS:
            self.accumulations.after(call, outputs)

    def _follow(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        keys: tuple[str, ...] = ()
        for t in call.tensors:
            found = self.marks.get(t)  # type: ignore[no-untyped-call]
            if found:
                keys += found
        if not keys:
            return
        name = call.info.name
        floats = [o for o in outputs if o.is_floating_point()]
        if name in _SINKS or not floats or all(o.dtype != torch.float32 for o in floats):
            # a loss, softmax, norm or reduction; a decision (bool/int out); or cast back down
            self.contained.update(keys)
            return
        mixes = any(t.is_floating_point() and _is_low(t) for t in call.tensors)
        if not mixes and (call.info.is_view or name in _CARRY or _pointwise(call.func)):
            for o in floats:
                self.marks[o] = keys
            return
        self.spread.update(keys)  # a matmul, or mixed into the 16-bit stream: the float32 spreads

    def _low_op(self, call: OpCall, name: str, outputs: list[torch.Tensor]) -> None:
        x = next((t for t in call.tensors if t.is_floating_point()), None)
        if x is None or not _is_low(x) or (name, call.module) in self.low_ops:
            return
        if name not in self.f32_ops.get(x.dtype, ()):
            return
        if not any(o.is_floating_point() and _is_low(o) for o in outputs):
            return  # the kernel was asked for float32 out (autocast's log_softmax: half_to_float)
        self.low_ops[(name, call.module)] = LowOp(
            name,
            call.module,
            x.dtype,
            tuple(x.shape),
            call.prov_of(x),
            _magnitude(name, x, _class_dim(name, call.args)),
            _made_by(call, x),
        )

    def _decide(self, call: OpCall, name: str, outputs: list[torch.Tensor]) -> None:
        floats = [o for o in outputs if o.is_floating_point()]
        made = _PROBS.get(name)
        if made is not None:
            # float32 probabilities too: a later cast back to 16-bit (`probs.type_as(x)`) is the loss
            for o in floats:
                self.probs[o] = made
            return
        found = next((self.probs.get(t) for t in call.tensors if t in self.probs), None)  # type: ignore[no-untyped-call]
        if name == "aten.add":
            # an expert bias kept in a 16-bit buffer, added to the scores before the choice: the
            # bias is rounded even where the sum is float32 (f32 scores + bf16 bias)
            buf = next((t for t in call.tensors if _is_low(t) and _kind(call, t) == "buffer"), None)
            if buf is not None:
                found = _ADDED_BUFFER
                for o in floats:
                    self.rounded[o] = buf.dtype
        if found is None:
            return
        if name in _DECISIONS:
            x = next(t for t in call.tensors if t in self.probs or _is_low(t))
            dtype = x.dtype if _is_low(x) else self.rounded.get(x)  # type: ignore[no-untyped-call]
            if dtype is not None and (name, call.module) not in self.decisions:
                width = int(x.shape[-1]) if x.dim() else 1
                self.decisions[(name, call.module)] = Decision(name, call.module, dtype, found, call.prov_of(x), width)
            return
        if call.info.is_view or _pointwise(call.func) or name in _CARRY or call.info.to_copy:
            kept = next((self.rounded.get(t) for t in call.tensors if t in self.rounded), None)  # type: ignore[no-untyped-call]
            for o in floats:
                self.probs[o] = found
                if kept is not None:
                    self.rounded[o] = kept

    def _logits(self, call: OpCall, name: str, outputs: list[torch.Tensor]) -> None:
        """Top-k taken on 16-bit logits as a matmul made them (through views only: an activation
        or a float32 copy of them is not what top-k chose on in 16-bit)."""
        if name in _LOGITS:
            for o in outputs:
                if o.is_floating_point() and _is_low(o):
                    self.logits[o] = True
            return
        x = next((t for t in call.tensors if t in self.logits), None)
        if x is None:
            return
        if name == "aten.topk" and x.dim() and (name, call.module) not in self.decisions:
            self.decisions[(name, call.module)] = Decision(
                name, call.module, x.dtype, LOGITS, call.prov_of(x), int(x.shape[-1])
            )
        elif call.info.is_view:
            for o in outputs:
                if o.is_floating_point():
                    self.logits[o] = True

    def finish(self, trace: Trace) -> None:
        trace.observed[NAME] = PrecisionRecord(
            frozenset(self.contained),
            frozenset(self.spread),
            tuple(self.low_ops.values()),
            tuple(self.positions.found.values()),
            tuple(self.decisions.values()),
            accumulation.found(self.accumulations),
        )
