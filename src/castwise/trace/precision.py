"""The precision observer: where values are computed narrower than intended, which nothing raises.

It records (``trace.observed["precision"]``, values of ``castwise.rules.audit._precision``):

- up-cast containment (CW120): the float32 a module returns in a 16-bit model, followed through
  scalar and view ops to what consumes it. Fed only to a loss, a softmax, a norm or a reduction
  (``logits.float()`` before cross-entropy) it is *contained*; reaching a matmul or mixing into a
  16-bit stream it *spreads*.
- 16-bit ops autocast would run in float32 (CW140), outside autocast. Whether autocast runs an op
  in float32 on the target is asked of torch itself (the op run once under that device's autocast
  on fake tensors, cached), never read from a list of our own.
- 16-bit tables of large magnitude given to sin/cos/exp/mul (CW141) and decisions on 16-bit
  probabilities (CW142).

Keep ``after`` cheap: it runs for every op. Its records are per origin chain (blocks generalize),
so a block reuse splice standing for a block's ops loses nothing the rules need (``splices``).
"""

from __future__ import annotations

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
from castwise.rules.audit._precision import NAME, Decision, LowOp, Narrowed, PrecisionRecord
from castwise.trace import fake, simcuda
from castwise.trace.attribution import tensors_of
from castwise.trace.observers import Observer, OpCall

if TYPE_CHECKING:
    from castwise.trace.events import Frame, Trace
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
# what makes router probabilities, by the name a finding gives it
_PROBS = {"aten._softmax": "softmax", "aten.sigmoid": "sigmoid"}


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


def _is_low(t: torch.Tensor) -> bool:
    return name_of(t.dtype) in LOW


def _kind(call: OpCall, t: torch.Tensor) -> str | None:
    prov = call.prov_of(t)
    return prov.kind if prov is not None else None


def _magnitude(op: str, x: torch.Tensor) -> float:
    """The size of what a loss-like op makes, from the shape alone: log-probabilities and
    cross-entropy are about ln(classes) (at initialisation, and for the tokens a model gets wrong)."""
    if x.dim() == 0:
        return 1.0
    classes = x.shape[1] if op.startswith("aten.nll_loss") and x.dim() >= 2 else x.shape[-1]
    return max(math.log(max(int(classes), 2)), 1.0) if "softmax" in op or "nll" in op or "logsumexp" in op else 1.0


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
        self.narrowed: dict[tuple[str, str], Narrowed] = {}
        self.decisions: dict[tuple[str, str], Decision] = {}
        self.probs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # 16-bit probabilities -> what made them

    def start(self, run: Run) -> None:
        self._reset()
        # asked before the run: inside an op the dispatcher excludes the autocast keys
        dt = run.device.autocast_type
        self.f32_ops = {d: frozenset(op for op in _LOSS_PROBES if autocast_f32(op, dt, d)) for d in _LOW_DTYPES}

    def module_exit(self, run: Run, frame: Frame, output: Any) -> None:
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
            name, call.module, x.dtype, tuple(x.shape), call.prov_of(x), _magnitude(name, x)
        )

    def _decide(self, call: OpCall, name: str, outputs: list[torch.Tensor]) -> None:
        low = [o for o in outputs if o.is_floating_point() and _is_low(o)]
        made = _PROBS.get(name)
        if made is not None:
            for o in low:
                self.probs[o] = made
            return
        found = next((self.probs.get(t) for t in call.tensors if t in self.probs), None)  # type: ignore[no-untyped-call]
        if name == "aten.add" and found is None:
            # an expert bias kept in a 16-bit buffer, added to the scores before the choice
            buf = next((t for t in call.tensors if _is_low(t) and _kind(call, t) == "buffer"), None)
            found = "an added 16-bit buffer" if buf is not None and low else None
        if found is None:
            return
        if name in _DECISIONS:
            x = next(t for t in call.tensors if t in self.probs or _is_low(t))
            if _is_low(x) and (name, call.module) not in self.decisions:
                width = int(x.shape[-1]) if x.dim() else 1
                self.decisions[(name, call.module)] = Decision(
                    name, call.module, x.dtype, found, call.prov_of(x), width
                )
            return
        if call.info.is_view or _pointwise(call.func) or name in _CARRY:
            for o in low:
                self.probs[o] = found

    def finish(self, trace: Trace) -> None:
        trace.observed[NAME] = PrecisionRecord(
            frozenset(self.contained),
            frozenset(self.spread),
            tuple(self.low_ops.values()),
            tuple(self.narrowed.values()),
            tuple(self.decisions.values()),
        )
