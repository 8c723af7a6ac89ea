"""The dtype-flow tracer: a dispatch mode plus global module hooks, with provenance.

Why this shape (each point was measured, see DESIGN.md "Engine principles"):

- Per-module hooks and TorchFunctionModes change the code path of TransformerEncoderLayer (its
  fast path checks for both), so modules are tracked with the *global* forward hooks and ops
  with a ``TorchDispatchMode``, which the fast path does not look for.
- Inside a dispatch-mode handler autocast is off. The caller's autocast state is captured at
  each module call (outside dispatch, where it is visible) and re-entered for the fused kernels
  that dispatch further ops themselves, or their failure disappears.
- Backward ops are attributed through autograd-node metadata: each node is tagged with the
  module that created it (lazily, when its output is next used), and read back from the node
  that runs the backward op.
- Provenance: every tensor maps to the origin of its current dtype, by the rule the compiled
  producer shares (``trace/provenance.py``).

- Per-op cost (a 405B audit runs ~60,000 ops): the op's fixed facts are looked up once by id
  (``trace/opinfo.py``), the contract once per (op, device), tensor metadata is read with
  subclass torch functions off, and a fake run's few real kernels (shadow values) run on one
  thread. ``benchmarks/bench_audit_7b.py`` measures it against the bare fake run.

The tracer keeps provenance; its parts keep the rest: ``trace/attribution.py`` the module stack and
phase, ``trace/values.py`` the values of small fake tensors, ``trace/record.py`` the record.
Everything else it does with an op (contract checks, up-casts, activation bytes, numerics) is an
observer (``castwise.trace.observers``), handed the parts as one ``Run``. No other module reads the
tracer's own attributes: this is the eager producer, and its parts are its interface.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from castwise import _autocast
from castwise.devices import Device
from castwise.devices import get as get_device
from castwise.trace import fastpath, hooks, provenance, source
from castwise.trace.attribution import Attribution, disabled_by
from castwise.trace.attrmap import AttrMap
from castwise.trace.backward import engine_replaced, tensor_hooks_recorded
from castwise.trace.contracts import Violation, tensor_args
from castwise.trace.cuda_guard import stand_in_guard
from castwise.trace.events import Event, Prov, Trace, shape_of
from castwise.trace.hop import is_hop, run_hop
from castwise.trace.observers import Observer, OpCall, Run, default_observers, needs_provenance, overrides, pick_loss
from castwise.trace.opinfo import _INFO, PRIM_DEVICE, info_of
from castwise.trace.record import Recorder
from castwise.trace.values import NO_VALUE, ShadowValues, one_thread

_aten = torch.ops.aten
# ops autocast runs in its low-precision dtype on every device: mixed floating operands reaching
# dispatch inside a module entered under autocast mean autocast was turned off around them
_AUTOCAST_LOW = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten.addbmm",
        "aten.addmv",
        "aten.mv",
        "aten.convolution",
        "aten._convolution",
        "aten.linear",
        "aten.matmul",
    }
)


def _flat_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


_NO_SUBCLASS_FUNCTION = torch._C.DisableTorchFunctionSubclass
_ADD = torch.ops.aten.add.Tensor  # nn.Linear's bias add on its matmul path (see _linear_bias_add)


_OWN_TYPES = frozenset({FakeTensor, torch.Tensor})


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _foreign(types: Sequence[type]) -> bool:
    """Whether an op's overloaded types include a tensor subclass other than the fake run's own.

    A subclass without its own ``__torch_dispatch__`` (nn.Parameter, whose ``.data`` reaches the
    mode as ``detach`` with the Parameter's type) is a plain tensor to the dispatcher: ours to run."""
    if _OWN_TYPES.issuperset(types):
        return False
    return any(t not in _OWN_TYPES and getattr(t, "__torch_dispatch__", None) is not _PLAIN_DISPATCH for t in types)


class Tracer(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every op's module, dtypes and provenance, and calls its observers on each. Its
    parts (attribution, shadow values, the recorder) are what others see, as one :class:`Run`."""

    supports_higher_order_operators = True  # torch.cond and kin come to __torch_dispatch__ (hop.py)

    def __init__(
        self,
        model: nn.Module,
        device: Device | str,
        *,
        fake: bool,
        record_ops: bool = True,
        observers: Sequence[Observer] | None = None,
        inputs: Sequence[tuple[str, torch.Tensor]] = (),
        values: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        forced: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        """``inputs``: the model's named input tensors (provenance seeds); ``values``: (fake, real)
        pairs whose values the run knows; ``forced``: branch sites answered True (the second run of
        a mode, trace/values.py)."""
        super().__init__()  # type: ignore[no-untyped-call]
        self.fake = fake
        self._quiet = False  # ops that only make a reused block's tensors pass unchecked (see quiet())
        self.prov = AttrMap("prov")  # tensor -> Prov (kept on the run's own tensors)
        self.recorder = Recorder(record_ops=record_ops)  # the run record's one writer
        self.trace = self.recorder.trace
        self.at = Attribution(model, get_device(device).autocast_type, lambda frame, out: self.run.exited(frame, out))
        self.values = ShadowValues(self.trace, self.at.module, forced)
        chosen = tuple(default_observers() if observers is None else observers)
        self.observers = list(chosen)
        stand = fastpath.Stand()
        self.run = Run(
            get_device(device), fake, self.recorder, self.at, self.values, stand, self.prov, chosen, self.quiet
        )
        # only the hooks an observer overrides are called: the per-op cost stays what it needs
        self._checkers = [o for o in chosen if overrides(o, "check")]
        self._afters = [o for o in chosen if overrides(o, "after")]
        self.provenance = needs_provenance(observers)  # off: each op keeps only its module (creator)
        self.recent: collections.deque[tuple[str, torch.Tensor]] = collections.deque(maxlen=8)
        for t, p in provenance.seeds(model):
            self.prov[t] = p
        for name, t in inputs:
            self.prov[t] = provenance.model_input(name, t)
        self.values.seed_values(list(values))
        hooks.observe_hooks(self.at, self.recorder, model)
        for obs in chosen:
            obs.start(self.run)

    # -- what the producer answers after the run (events.Producer) ----------------------------

    @property
    def refused(self) -> tuple[str, list[torch.Tensor]] | None:
        return self.at.refused

    def prov_of(self, t: torch.Tensor) -> Prov | None:
        found: Prov | None = self.prov.get(t)
        return found

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Ops that only make tensors a record stands for: neither checked nor recorded."""
        before, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = before

    # -- the handler -------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is PRIM_DEVICE:  # asked by C++ for about every op: answered as FakeTensor does
            mode = getattr(args[0], "fake_mode", None) if len(args) == 1 else None
            if mode is not None and not mode.in_kernel_invocation:
                return args[0].fake_device
            return func(*args, **(kwargs or {}))
        if self._quiet:
            return func(*args, **(kwargs or {}))
        if is_hop(func):  # torch.cond and kin (supports_higher_order_operators)
            return run_hop(self, self.recorder, func, args, kwargs or {})
        if types and _foreign(types):
            # a tensor subclass (torchao's float8 tensors, DTensor, NF4) implements the op itself:
            # it runs its own code, whose ops on plain tensors come back here and are checked
            # against the real kernels' contracts; the subclass's dtype says nothing about them
            return NotImplemented
        # the handler reads tensors' metadata (dtype, shape, is_floating_point) dozens of times per
        # op: on a tensor subclass (FakeTensor) each read is a Python __torch_function__ call
        # unless subclass torch functions are off (measured: 0.5-1.4 µs a read, ten times less)
        with _NO_SUBCLASS_FUNCTION():
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The handler proper: scalar values, contract checks, the op, provenance, observers."""
        info = _INFO.get(id(func)) or info_of(func)
        tensors = _flat_tensors(args, kwargs)
        if info.scalar:
            value = self._scalar(func, args, kwargs, tensors)
            if value is not NO_VALUE:
                return value
        at = self.at
        module = at.module()
        name = info.name
        is_fast = info.fast
        forward = at.phase == "forward"
        if forward and tensors and torch.is_grad_enabled():
            at.tag_nodes(tensors)
        # read per op, not cached: the table may change while a process runs (a test patches it)
        own_fake = fastpath.OWN_FAKE.get(func) if self.fake else None
        call = OpCall(self.run, func, name, module, args, kwargs, tensors, is_fast, info)
        for obs in self._checkers:
            violation = obs.check(call)
            if violation is not None:
                self.recorder.event(self._event(func, name, module, args, kwargs, violation, None, is_fast))
        try:
            if is_fast and self.fake and fastpath.needs_fake_run(func, args, self.run.stand):
                mask = self.values.value_of(args[1]) if func in fastpath.LEFT_ALIGNED and len(args) > 1 else None
                out = fastpath.run_fake(func, args, kwargs, self.run.stand, mask)
            elif is_fast:
                out = self._run_with_caller_autocast(func, args, kwargs)
            elif own_fake is not None:
                out = own_fake(self.values, func, args, kwargs)
            else:
                out = func(*args, **kwargs)
                if func is _ADD and self.fake and self._linear_bias_add(args, out):
                    # ATen's linear (matmul path: a non-contiguous input) adds a plain bias in
                    # place, keeping the product's dtype, but a tensor subclass's (a fake one's)
                    # out of place, promoting it: the fake run follows the real tensors' branch
                    out = out.to(args[0].dtype)
        except Exception as exc:
            self.recorder.failure(self._event(func, name, module, args, kwargs, None, exc, is_fast))
            raise
        outs = self._propagate(func, name, module, tensors, out, forward)
        if self.values.shadow_count and not is_fast:
            self.values.shadow_run(func, args, kwargs, tensors, out)
        if self.fake:
            self.values.remember(func, args, kwargs, tensors, out)
        for obs in self._afters:
            obs.after(call, outs)
        return out

    def _linear_bias_add(self, args: tuple[Any, ...], out: Any) -> bool:
        """Whether this ``add`` is nn.Linear's own bias add whose real result keeps the product's dtype."""
        if len(args) != 2 or not self.at.stack or not isinstance(out, torch.Tensor):
            return False
        product, bias = args
        module = self.at.stack[-1].module
        return (
            isinstance(module, nn.Linear)
            and bias is module.bias
            and isinstance(product, torch.Tensor)
            and out.dtype != product.dtype
            and product.is_floating_point()
        )

    def _scalar(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
        """The value of an op that returns a Python value (``.item()``, a truth value) when the
        tracer supplies it, else NO_VALUE (the op runs as any other)."""
        if self.fake and tensors and not any(type(t).__name__ == "FakeTensor" for t in tensors):
            # real stand-in values (a fast-path mask check) run for real, outside the fake mode
            with _disable_current_modes():
                return func(*args, **kwargs)
        if self.values.shadow_count:
            value = self.values.shadow_value(func, args, kwargs, tensors)
            if value is not NO_VALUE:
                return value
        if self.fake:  # a value no shadow knows: a branch (trace/values.py)
            return self.values.branch_value(func, tensors, self.at.module())
        return NO_VALUE

    def _run_with_caller_autocast(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dtype = self.at.autocast_here()
        if dtype is None:
            return func(*args, **kwargs)
        with _autocast.autocast(self.at.device_type, dtype):
            return func(*args, **kwargs)

    def _event(
        self,
        func: Any,
        name: str,
        module: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        violation: Violation | None,
        error: BaseException | None,
        is_fast: bool,
    ) -> Event:
        tensors = tensor_args(args, kwargs)
        dtypes = tuple(t.dtype for t in tensors)
        at = self.at
        forward = at.phase == "forward"
        return Event(
            at.phase,
            module,
            name,
            violation,
            error,
            dtypes,
            tuple(shape_of(t) for t in tensors),
            tuple(self.prov.get(t) for t in tensors),
            at.autocast_here(),
            is_fast,
            # mixed floating operands of an op autocast casts, inside a module entered under autocast
            disabled_by(at.stack, dtypes, lambda _f: info_of(func).name in _AUTOCAST_LOW) if forward else None,
        )

    def _propagate(
        self, func: Any, name: str, module: str, tensors: list[torch.Tensor], out: Any, forward: bool
    ) -> list[torch.Tensor]:
        if isinstance(out, torch.Tensor):
            outs: list[torch.Tensor] = [out]
        elif isinstance(out, (tuple, list)):
            outs = [o for o in out if isinstance(o, torch.Tensor)]
        else:
            return []
        # the maps' dicts read inline: this loop runs for every output of every op
        pkey = self.prov.key
        ckey = self.at.creator.key
        if not self.provenance:
            if forward:  # the creator names the module of the output's autograd node (backward attribution)
                for o in outs:
                    odict = o.__dict__
                    if pkey not in odict:  # in-place (or a seeded parameter): it keeps what it had
                        odict.setdefault(ckey, module)
            self.recorder.op(module, name, self.at.phase, tensors, outs)
            return outs
        several = len(tensors) > 1
        cast = info_of(func).to_copy
        for o in outs:
            odict = o.__dict__
            if pkey in odict:  # in-place: the tensor keeps its origin
                continue
            dtype = o.dtype
            found = [(p, t) for t in tensors if t.dtype is dtype and (p := t.__dict__.get(pkey)) is not None]
            chosen = provenance.kept(found, several, name, module, o, cast=cast, forward=forward) if found else None
            if chosen is None:
                chosen = self._new_origin(name, module, tensors, o, cast)
            odict[pkey] = chosen
            if forward:
                odict[ckey] = module
                if cast or o.is_floating_point():
                    # the last tensors made here: the operands of a call that raises before it
                    # reaches dispatch (sdpa's own q/k/v check, a layer's Python dtype check,
                    # one_hot's check of an index cast on its own line)
                    self.recent.append((module, o))
        self.recorder.op(module, name, self.at.phase, tensors, outs)
        return outs

    def _new_origin(self, name: str, module: str, tensors: list[torch.Tensor], o: torch.Tensor, cast: bool) -> Prov:
        pkey = self.prov.key
        return provenance.made(
            name,
            module,
            o,
            [(t.__dict__.get(pkey), t) for t in tensors],
            cast=cast,
            forward=self.at.phase == "forward",
            autocast=self.at.autocast_here(),
            # where the dtype was made in the user's code: only here, never per op (it walks the stack)
            line=source.where,
            hook=self.at.hook_stack[-1] if self.at.hook_stack else None,
        )


# -- running a model under the tracer ---------------------------------------------------------


def call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return model(*args, **kwargs)


@contextmanager
def traced(tracer: Tracer, *, engine_backward: bool = True) -> Iterator[Run]:
    """One run under ``tracer``, its parts in hand: the module hooks on and the mode entered. A
    model error is caught and recorded (with the module stack at the raise); at the end every
    observer is told the run ended. ``engine_backward`` False: a simulated device, whose fake
    tensors need the stand-in guard to carry gradients."""
    at = tracer.at
    # the stand-in guard entered outside the try: a build it cannot serve is castwise's error, not the model's
    with stand_in_guard() if not engine_backward else nullcontext(), at.running():
        try:
            hooks_kept = tensor_hooks_recorded() if not engine_backward else nullcontext()
            # gradient hooks registered on activations during the run; sdpa's operands when it refuses
            user_hooks = hooks.tensor_hooks(at, tracer.recorder), hooks.refused_operands(at)
            with at.module_hooks(), user_hooks[0], user_hooks[1], hooks_kept, one_thread(tracer.fake), tracer:
                yield tracer.run
        except Exception as exc:  # the model's own error: becomes a finding
            tracer.recorder.raised(exc, list(at.stack), at.phase)
        finally:
            for obs in tracer.run.observers:
                obs.finish(tracer.trace)
    tracer.recorder.ended()


def run(
    tracer: Tracer,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: str,
    *,
    engine_backward: bool,
) -> Trace:
    """Run ``model`` once in ``mode`` ("train": forward + backward; "eval": no_grad) under
    ``tracer``. A model error is caught and recorded (with the module stack at the raise)."""
    at = tracer.at
    enabled = torch.is_autocast_enabled(at.device_type)
    at.root_autocast = torch.get_autocast_dtype(at.device_type) if enabled else None
    at.root_entered = len(_autocast.ENTERED)
    model.train(mode != "eval")
    with traced(tracer, engine_backward=engine_backward):
        if mode == "eval":
            with torch.no_grad():
                call(model, args, kwargs)
        else:
            with torch.enable_grad():
                out = call(model, args, kwargs)
                at.end_forward(out)
                loss = pick_loss(out)
                if loss is not None:
                    at.begin_backward()
                    with nullcontext() if engine_backward else engine_replaced(at):
                        loss.backward()  # type: ignore[no-untyped-call]
    return tracer.trace
