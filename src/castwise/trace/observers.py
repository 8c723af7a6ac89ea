"""Observers: what the tracer does with each op, beyond provenance.

The tracer (a dispatch mode) runs every op, keeps provenance, and calls its observers:
``check`` before the op runs (a contract check answers with a ``Violation``), ``after`` once it
ran (its outputs in hand), ``module_exit`` when a module returns, ``finish`` at the end of the
run. Contract checks, silent up-casts and activation bytes are observers; numerics and the
report's module tree are more. A new observer subclasses :class:`Observer`, overrides what it
needs, and is passed as ``Tracer(..., observers=[...])``: the tracer itself does not change.

Observers are called for every op of a 405B-parameter audit: keep ``after`` cheap, and do not
override a hook you do not need (the tracer only calls the hooks an observer overrides).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from castwise._dtypes import LOW as _LOW_NAMES
from castwise._dtypes import name_of
from castwise.trace import contracts, fastpath
from castwise.trace.attribution import tensors_of
from castwise.trace.events import Upcast, shape_of
from castwise.trace.opinfo import OpInfo, info_of

if TYPE_CHECKING:
    from castwise.devices import Device
    from castwise.trace.attribution import Attribution
    from castwise.trace.attrmap import AttrMap
    from castwise.trace.contracts import Violation
    from castwise.trace.events import Frame, Phase, Prov, Trace
    from castwise.trace.record import Recorder
    from castwise.trace.values import ShadowValues


class OpCall:
    """One op as the tracer sees it. A plain slotted object, not a dataclass: one is made per op."""

    __slots__ = ("args", "func", "info", "is_fast", "kwargs", "module", "name", "phase", "run", "tensors")

    def __init__(
        self,
        run: Run,
        func: Any,
        name: str,
        module: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
        is_fast: bool,
        info: OpInfo | None = None,
    ) -> None:
        self.run = run
        self.func = func  # the aten OpOverload
        self.name = name  # "aten.addmm"
        self.module = module  # named_modules() name ("" at the top level)
        self.phase = run.at.phase
        self.args = args
        self.kwargs = kwargs
        self.tensors = tensors  # the op's tensor arguments, flattened
        self.is_fast = is_fast  # a fused fast-path kernel (TransformerEncoderLayer, MHA)
        self.info = info if info is not None else info_of(func)  # the op's fixed facts, cached

    @property
    def device(self) -> Any:
        """The simulated target device (a ``castwise.devices.Device``)."""
        return self.run.device

    @property
    def trace(self) -> Trace:
        return self.run.trace

    @property
    def record(self) -> Recorder:
        """The run record's writer (what an observer adds to the record goes through it)."""
        return self.run.recorder

    # what an observer may ask of the run beyond the op itself (not the tracer's own state)

    def prov_of(self, t: torch.Tensor) -> Prov | None:
        """The origin of ``t``'s dtype."""
        return self.run.prov_of(t)

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype the caller of this op ran under (forward only; None when off)."""
        return self.run.autocast_here()

    @property
    def stand(self) -> fastpath.Stand:
        """The fused fast paths' state for this run (which kernels the model's modules chose)."""
        return self.run.stand

    def backward_node(self) -> Any:
        """In backward, the autograd node running this op (None in forward)."""
        if self.phase != "backward":
            return None
        at = self.run.at
        return at.current_node if not at.use_engine_node else torch._C._current_autograd_node()


@dataclass(frozen=True, eq=False)
class Run:
    """What an observer may ask of the run beyond the op itself: the eager producer's parts, never
    the producer. Made once per run; every op's :class:`OpCall` and every module exit carry it."""

    device: Device
    fake: bool
    recorder: Recorder  # the run record's one writer
    at: Attribution  # the module stack, phase and autograd node tags
    values: ShadowValues  # what is known of fake tensors' values (masks, ids)
    stand: fastpath.Stand  # the fused fast paths' state (which kernels the model's modules chose)
    prov: AttrMap  # tensor -> the origin of its dtype
    observers: tuple[Observer, ...]
    # ops run inside only make tensors a record stands for (block reuse): neither checked nor recorded
    quiet: Callable[[], AbstractContextManager[None]]

    @property
    def trace(self) -> Trace:
        return self.recorder.trace

    @property
    def phase(self) -> Phase:
        return self.at.phase

    def prov_of(self, t: torch.Tensor) -> Prov | None:
        found: Prov | None = self.prov.get(t)
        return found

    def autocast_here(self) -> torch.dtype | None:
        return self.at.autocast_here()

    def adopt(self, t: torch.Tensor, prov: Prov | None, creator: str | None = None) -> None:
        """``t`` was made for the run without its ops (a reused block's, ``trace/reuse.py``)."""
        self.prov[t] = prov
        if creator is not None:
            self.at.creator[t] = creator

    def exited(self, frame: Frame, output: Any) -> None:
        """A module's forward returned ``output``: every observer that asks is told."""
        for obs in self.observers:
            if overrides(obs, "module_exit"):
                obs.module_exit(self, frame, output)


class Observer:
    """Base class: every hook does nothing. Override the ones you need."""

    name = "observer"
    # what this observer reads of the tracer beyond the op itself. "provenance": each tensor's
    # origin (contract checks' events, an audit's findings). A run whose observers all leave it out
    # gets a tracer that skips it in its per-op hot path (module attribution is always kept)
    needs: frozenset[str] = frozenset({"provenance"})
    # whether a reused block's record stands for what this observer records of the block's ops
    # (``trace/reuse.py``): true where it writes only through the record (ops, events, activation
    # bytes, upcasts at module exits, which are replayed). False: every block runs for it
    splices = False

    def check(self, call: OpCall) -> Violation | None:
        """Before the op runs: the violation a real kernel would raise, or None."""
        return None

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        """After the op ran (not called when it raised)."""

    def start(self, run: Run) -> None:
        """The run is about to begin (its parts in hand; an observer that steers it keeps them)."""

    def module_exit(self, run: Run, frame: Frame, output: Any) -> None:
        """A module's forward returned ``output`` (forward phase only)."""

    def finish(self, trace: Trace) -> None:
        """The run ended (also when the model raised)."""


def overrides(observer: Observer, hook: str) -> bool:
    """True when ``observer`` defines its own ``hook`` (the tracer skips the base no-ops)."""
    return getattr(type(observer), hook) is not getattr(Observer, hook)


def needs_provenance(observers: Sequence[Observer] | None) -> bool:
    """Whether a tracer with ``observers`` keeps provenance: the defaults and an empty list (no one
    said otherwise) do; a list whose every observer declares it needs none does not."""
    return not observers or any("provenance" in o.needs for o in observers)


def pick_loss(out: Any) -> torch.Tensor | None:
    """The model's loss if it returns one, else a float32 reduction of its first output."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss.float().sum() if loss.dim() else loss.float()
    for t in tensors_of(out):
        if t.is_floating_point() and t.requires_grad:
            return t.float().sum()
    return None


# -- the built-in observers ----------------------------------------------------------------------


class ContractObserver(Observer):
    """Checks every op against what the target device's real kernel accepts (trace/contracts)."""

    name = "contracts"
    splices = True

    def check(self, call: OpCall) -> Violation | None:
        func = call.func
        info = call.info
        if call.is_fast:
            if info.fused:
                v = fastpath.check_fused(func, call.args, call.kwargs, call.stand, call.autocast)
                # the table has the kernel's measured exceptions (f32 norms with a 16-bit input,
                # a qkv bias of any float dtype on CPU): the fused path fails only where it refuses too
                if v is not None and contracts.check(func, call.args, call.kwargs, call.device) is None:
                    return None
                return v
            return None
        if info.rnn:
            first = call.args[0] if call.args else None
            origin = call.prov_of(first) if isinstance(first, torch.Tensor) else None
            cast = origin is not None and origin.kind == "autocast"
            return fastpath.check_rnn_cell(func, call.args, call.kwargs, call.device, cast)
        # one lookup (cached per op and device) answers both coverage and the check
        found = contracts.lookup(func, call.device)
        if not found.covered:
            call.record.uncovered(call.name, call.module)
            mixed = call.run.fake and contracts.mixed_width(
                call.name, call.module, call.phase, call.tensors, call.prov_of
            )
            if mixed:  # CW160: mixed widths into an op no contract speaks for
                call.trace.observed.setdefault("mixed_width", []).append(mixed)
        return found.check(call.args, call.kwargs)


class ActivationBytesObserver(Observer):
    """Bytes of floating activations made in forward, by dtype (views and in-place writes excluded)."""

    name = "activation_bytes"
    splices = True

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        if call.phase != "forward" or call.info.is_view:
            return
        for o in outputs:
            if o.is_floating_point() and not o.is_nested and not any(o is t for t in call.tensors):
                call.record.activation(name_of(o.dtype), o.numel() * o.element_size())


class UpcastObserver(Observer):
    """Modules that take low-precision activations and return float32 outside autocast (CW120)."""

    name = "upcasts"
    splices = True

    def module_exit(self, run: Run, frame: Frame, output: Any) -> None:
        if frame.autocast is not None or not frame.name:
            return
        ins = [t for t in frame.inputs if t.is_floating_point()]
        if not ins or not all(name_of(t.dtype) in _LOW_NAMES for t in ins):
            return
        for t in tensors_of(output):
            if name_of(t.dtype) == "float32":
                run.recorder.upcast(Upcast(frame.name, ins[0].dtype, run.prov_of(t), shape_of(t)))
                break


@dataclass(frozen=True)
class Narrowed:
    """A complex tensor cast to a real dtype: torch keeps the real part and drops the imaginary one
    (Copy.cpp only warns), so nothing raises and the values are another function's."""

    module: str
    op: str
    phase: str
    src: torch.dtype
    dst: torch.dtype
    shape: tuple[int, ...]
    origin: Prov | None  # where the complex tensor came from
    cast: Prov | None  # the cast itself (its line)


# the ops a cast reaches in dispatch (.to, type_as, .float(), copy_ into a real tensor)
_CASTS = frozenset({"aten._to_copy", "aten.copy_", "aten.copy", "aten.to"})


class ComplexToRealObserver(Observer):
    """Casts that turn a complex tensor real (CW117): trace.observed["complex_to_real"]."""

    name = "complex_to_real"
    # a reused block's casts are its first run's: the rule names each cast once per generalized
    # module (blocks.0 for blocks.*), so the block that ran stands for the ones replayed
    splices = True

    def __init__(self) -> None:
        self.seen: list[Narrowed] = []

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        if call.name not in _CASTS or not outputs:
            return
        src = call.tensors[-1] if call.name.startswith("aten.copy") else call.tensors[0]
        out = outputs[0]
        if src.dtype.is_complex and not out.dtype.is_complex:
            self.seen.append(
                Narrowed(
                    call.module, call.name, call.phase, src.dtype, out.dtype, shape_of(out),
                    call.prov_of(src), call.prov_of(out),
                )
            )  # fmt: skip

    def finish(self, trace: Trace) -> None:
        trace.observed[self.name] = list(self.seen)


def default_observers() -> list[Observer]:
    """What an audit observes: contracts, silent up-casts, activation bytes, complex made real."""
    return [ContractObserver(), UpcastObserver(), ActivationBytesObserver(), ComplexToRealObserver()]
