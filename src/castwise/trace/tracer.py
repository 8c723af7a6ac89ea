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

The tracer keeps provenance and the module stack; everything else it does with an op (contract
checks, up-casts, activation bytes, numerics) is an observer (``castwise.trace.observers``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
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
from castwise.trace.attrmap import AttrMap
from castwise.trace.backward import engine_replaced, tensor_hooks_recorded
from castwise.trace.contracts import Violation, tensor_args
from castwise.trace.cuda_guard import stand_in_guard
from castwise.trace.events import Event, Frame, Prov, Trace, shape_of
from castwise.trace.hop import is_hop, run_hop
from castwise.trace.observers import (
    Observer,
    OpCall,
    default_observers,
    flat_outputs,
    needs_provenance,
    overrides,
    pick_loss,
)
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


class Tracer(ShadowValues, TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every op's module, dtypes and provenance, and calls its observers on each."""

    supports_higher_order_operators = True  # torch.cond and kin come to __torch_dispatch__ (hop.py)

    def __init__(
        self,
        model: nn.Module,
        device: Device | str,
        *,
        fake: bool,
        record_ops: bool = True,
        observers: Sequence[Observer] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names: dict[int, str] = {id(m): n for n, m in model.named_modules()}
        self.device = get_device(device)
        self.device_type = self.device.autocast_type
        self.fake = fake
        self._quiet = False  # ops that only make a reused block's tensors pass unchecked (see quiet())
        # tensor -> Prov, tensor -> module that made it (kept on the run's own tensors)
        self.prov: Any = AttrMap("prov")
        self.creator: Any = AttrMap("creator")
        self.stack: list[Frame] = []
        self.phase: Any = "forward"
        self.root_autocast: torch.dtype | None = None
        self.current_node: Any = None  # set by the Python backward walker
        self.use_engine_node = True
        self.recorder = Recorder(record_ops=record_ops)  # the run record's one writer
        self.trace = self.recorder.trace
        self.stand = fastpath.Stand()
        self.shadow: Any = AttrMap("value")  # fake tensor -> real CPU tensor with its values
        self.shadow_count = 0
        self.recipe: Any = AttrMap("recipe")  # fake mask/count/id tensor -> the op that made it (values.py)
        self.assumed_now = 0
        self.observers: list[Observer] = list(default_observers() if observers is None else observers)
        # only the hooks an observer overrides are called: the per-op cost stays what it needs
        self._checkers = [o for o in self.observers if overrides(o, "check")]
        self._afters = [o for o in self.observers if overrides(o, "after")]
        self._exits = [o for o in self.observers if overrides(o, "module_exit")]
        self.provenance = needs_provenance(observers)  # off: each op keeps only its module (creator)
        self.hook_stack: list[str] = []  # the user forward hooks running now (innermost last)
        self.recent: collections.deque[tuple[str, torch.Tensor]] = collections.deque(maxlen=8)
        self.refused: tuple[str, list[torch.Tensor]] | None = None  # (module, operands) sdpa refused
        self._seed(model)
        hooks.observe_hooks(self, model)

    def finish(self) -> None:
        """Tell every observer the run ended."""
        for obs in self.observers:
            obs.finish(self.trace)

    # -- the phase protocol of one run (run() below and numerics' layerwise run share it) ----

    @contextmanager
    def running(self) -> Iterator[None]:
        """One run: it starts in forward; on exit, also after a raise, the module stack is closed,
        the phase is forward again and every observer is told the run ended."""
        self.phase = "forward"
        try:
            yield
        finally:
            self.stack.clear()
            self.phase = "forward"
            self.finish()

    def end_forward(self, out: Any) -> None:
        """The forward returned ``out``: its tensors' autograd nodes name the modules that made
        them (backward attributes its ops by them) and no module is running any more."""
        self.tag_outputs(out)
        self.stack.clear()

    def begin_backward(self) -> None:
        self.phase = "backward"

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """A forward run again inside backward (a block recomputed for its gradients)."""
        self.phase = "forward"
        try:
            yield
        finally:
            self.phase = "backward"

    # -- provenance seeds --------------------------------------------------------------------

    def _seed(self, model: nn.Module) -> None:
        for t, p in provenance.seeds(model):
            self.prov[t] = p

    def seed_inputs(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            self.prov[t] = provenance.model_input(name, t)

    def prov_of(self, t: torch.Tensor) -> Prov | None:
        found: Prov | None = self.prov.get(t)
        return found

    def creator_of(self, t: torch.Tensor) -> str:
        return str(self.creator.get(t, ""))

    def adopt(self, t: torch.Tensor, prov: Prov | None, creator: str | None = None) -> None:
        """``t`` was made for the run without its ops (a reused block's, ``trace/reuse.py``)."""
        self.prov[t] = prov
        if creator is not None:
            self.creator[t] = creator

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Ops that only make tensors a record stands for: neither checked nor recorded."""
        before, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = before

    # -- module stack (global hooks) ---------------------------------------------------------

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        enabled = torch.is_autocast_enabled(self.device_type)
        dtype = torch.get_autocast_dtype(self.device_type) if enabled else None
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.stack.append(Frame(name, module, dtype, tensors))

    def _post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        # pop to this module's frame (a child that raised inside a caught exception left its own)
        while self.stack:
            frame = self.stack.pop()
            if frame.module is module:
                break
        else:
            return
        if self.phase == "forward":
            self.module_exited(frame, output)

    def module_exited(self, frame: Frame, output: Any) -> None:
        for obs in self._exits:
            obs.module_exit(self, frame, output)

    @contextmanager
    def hooks(self) -> Iterator[None]:
        from torch.nn.modules import module as module_mod

        pre = module_mod.register_module_forward_pre_hook(self._pre_hook)
        post = module_mod.register_module_forward_hook(self._post_hook)
        try:
            # gradient hooks registered on activations during the run; sdpa's operands when it refuses
            with hooks.tensor_hooks(self), hooks.refused_operands(self):
                yield
        finally:
            pre.remove()
            post.remove()

    def module(self) -> str:
        if self.phase == "forward":
            return self.stack[-1].name if self.stack else ""
        node: Any = self.current_node if not self.use_engine_node else torch._C._current_autograd_node()
        if node is None:
            return ""
        found: str = node.metadata.get("castwise", "")
        return found

    def autocast_here(self) -> torch.dtype | None:
        if self.phase != "forward":
            return None
        return self.stack[-1].autocast if self.stack else self.root_autocast

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
            return run_hop(self, func, args, kwargs or {})
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
        module = self.module()
        name = info.name
        is_fast = info.fast
        forward = self.phase == "forward"
        if forward and tensors and torch.is_grad_enabled():
            self._tag_nodes(tensors)
        # read per op, not cached: the table may change while a process runs (a test patches it)
        own_fake = fastpath.OWN_FAKE.get(func) if self.fake else None
        call = OpCall(self, func, name, module, args, kwargs, tensors, is_fast, info)
        for obs in self._checkers:
            violation = obs.check(call)
            if violation is not None:
                self.recorder.event(self._event(func, name, module, args, kwargs, violation, None, is_fast))
        try:
            if is_fast and self.fake and fastpath.needs_fake_run(func, args, self.stand):
                mask = self.value_of(args[1]) if func in fastpath.LEFT_ALIGNED and len(args) > 1 else None
                out = fastpath.run_fake(func, args, kwargs, self.stand, mask)
            elif is_fast:
                out = self._run_with_caller_autocast(func, args, kwargs)
            elif own_fake is not None:
                out = own_fake(self, func, args, kwargs)
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
        if self.shadow_count and not is_fast:
            self._shadow_run(func, args, kwargs, tensors, out)
        if self.fake:
            self.remember(func, args, kwargs, tensors, out)
        for obs in self._afters:
            obs.after(call, outs)
        return out

    def _linear_bias_add(self, args: tuple[Any, ...], out: Any) -> bool:
        """Whether this ``add`` is nn.Linear's own bias add whose real result keeps the product's dtype."""
        if len(args) != 2 or not self.stack or not isinstance(out, torch.Tensor):
            return False
        product, bias = args
        module = self.stack[-1].module
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
        if self.shadow_count:
            value = self._shadow_value(func, args, kwargs, tensors)
            if value is not NO_VALUE:
                return value
        if self.fake:  # a value no shadow knows: a branch (trace/values.py)
            return self.branch_value(func, tensors, self.module())
        return NO_VALUE

    def _run_with_caller_autocast(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dtype = self.autocast_here()
        if dtype is None:
            return func(*args, **kwargs)
        with _autocast.autocast(self.device_type, dtype):
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
        return Event(
            self.phase,
            module,
            name,
            violation,
            error,
            dtypes,
            tuple(shape_of(t) for t in tensors),
            tuple(self.prov.get(t) for t in tensors),
            self.autocast_here(),
            is_fast,
            self._disabled_by(func, dtypes) if self.phase == "forward" else None,
        )

    def _disabled_by(self, func: Any, dtypes: tuple[torch.dtype, ...]) -> str | None:
        """The module whose forward turned autocast off around this op, or None.

        Autocast's state cannot be read inside a dispatch handler, but it is recorded at each
        module's entry. A module entered with autocast on whose op (or child) runs without it
        turned it off in its forward: a child entered with autocast off, or an op autocast casts
        (a matmul, a conv) reaching dispatch with mixed floating operands."""
        stack = self.stack
        deepest = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].autocast is not None), None)
        if deepest is None:
            return None
        if deepest < len(stack) - 1:
            return stack[deepest].name
        floats = {d for d in dtypes if d.is_floating_point}
        # autocast never casts float64 operands: a float64 one reaches the kernel as it is anyway
        if info_of(func).name in _AUTOCAST_LOW and len(floats) > 1 and torch.float64 not in floats:
            return stack[deepest].name
        return None

    def _tag_nodes(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.requires_grad:
                node: Any = t.grad_fn
                if node is not None:
                    meta: dict[str, Any] = node.metadata
                    if "castwise" not in meta:
                        meta["castwise"] = self.creator.get(t, "")

    def tag_outputs(self, out: Any) -> None:
        """Tag the nodes of the model's outputs (never used as an op input inside forward)."""
        self._tag_nodes(flat_outputs(out))

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
        ckey = self.creator.key
        if not self.provenance:
            if forward:  # the creator names the module of the output's autograd node (backward attribution)
                for o in outs:
                    odict = o.__dict__
                    if pkey not in odict:  # in-place (or a seeded parameter): it keeps what it had
                        odict.setdefault(ckey, module)
            self.recorder.op(module, name, self.phase, tensors, outs)
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
                if o.is_floating_point():
                    # the last tensors made here: the operands of a call that raises before it
                    # reaches dispatch (sdpa's own q/k/v check, a layer's Python dtype check)
                    self.recent.append((module, o))
        self.recorder.op(module, name, self.phase, tensors, outs)
        return outs

    def _new_origin(self, name: str, module: str, tensors: list[torch.Tensor], o: torch.Tensor, cast: bool) -> Prov:
        pkey = self.prov.key
        return provenance.made(
            name,
            module,
            o,
            [(t.__dict__.get(pkey), t) for t in tensors],
            cast=cast,
            forward=self.phase == "forward",
            autocast=self.autocast_here(),
            # where the dtype was made in the user's code: only here, never per op (it walks the stack)
            line=source.where,
            hook=self.hook_stack[-1] if self.hook_stack else None,
        )


# -- running a model under the tracer ---------------------------------------------------------


def call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return model(*args, **kwargs)


def run(
    tracer: Tracer,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: str,
    *,
    engine_backward: bool,
    enter: Callable[[], Any] | None = None,
) -> Trace:
    """Run ``model`` once in ``mode`` ("train": forward + backward; "eval": no_grad) under
    ``tracer``. A model error is caught and recorded (with the module stack at the raise)."""
    trace = tracer.trace
    enabled = torch.is_autocast_enabled(tracer.device_type)
    tracer.root_autocast = torch.get_autocast_dtype(tracer.device_type) if enabled else None
    if mode == "eval":
        model.eval()
    else:
        model.train()
    # no engine: a simulated device, whose fake tensors need the stand-in guard to carry gradients
    # (entered outside the try: a build it cannot serve is castwise's error, not the model's)
    with stand_in_guard() if not engine_backward else nullcontext(), tracer.running():
        try:
            hooks_kept = tensor_hooks_recorded() if not engine_backward else nullcontext()
            with tracer.hooks(), hooks_kept, one_thread(tracer.fake), tracer:
                if mode == "eval":
                    with torch.no_grad():
                        call(model, args, kwargs)
                else:
                    with torch.enable_grad():
                        out = call(model, args, kwargs)
                        tracer.end_forward(out)
                        loss = pick_loss(out)
                        if loss is not None:
                            tracer.begin_backward()
                            if engine_backward:
                                loss.backward()  # type: ignore[no-untyped-call]
                            else:
                                with engine_replaced(tracer):
                                    loss.backward()  # type: ignore[no-untyped-call]
        except Exception as exc:  # the model's own error: becomes a finding
            tracer.recorder.raised(exc, list(tracer.stack), tracer.phase)
    tracer.recorder.ended()
    return trace
