"""Repeated blocks traced once: a block that matches one already traced reuses its record.

A 7B Llama runs 32 identical decoder layers; tracing each costs as much as the fake run itself.
During a fake run, each *block* (a composite module in a ``ModuleList``/``Sequential`` beside
another of its class, outermost only: ``trace/blocks.py``) is keyed by everything its record
depends on:

- static: class and forward (an instance override, a policy's island wrapper: by code and
  closure), per submodule; parameter, buffer and tensor-attribute dtype, shape, stride, device,
  requires_grad and type; plain attributes (bool, str, float, None; ints other than an index);
  training mode. Any hook (forward, pre, backward, a parameter's gradient hook, a global hook
  beside the tracer's own) keeps the block out: it traces for itself.
- per call: the structure of its arguments; each tensor's type, dtype, shape, stride, device,
  requires_grad and aliasing; plain values by value, other objects by identity; the autocast
  state and grad mode. A tensor whose values the tracer knows (a mask, ids: ``values.py``) keeps
  the call out.

The first block of a key is traced and its record kept (the ops, events, activation bytes and
module exits it produced), unless its run did something a record cannot stand for: a
data-dependent branch or value assumption, a hook that changed a dtype, an output that is an
input or carries known values. A later block with the same key does not run: an autograd
Function makes its outputs (fake tensors with the recorded dtype, shape and stride; backward
gives gradients in each input's dtype), their provenance is the record's, renamed (the
template's inputs and parameters map to this block's, every module name is this block's), and
the record is spliced in renamed, so findings in a reused block name that block. The backward
record is spliced when the run ends, at the place where the reused block's backward ran.

Not replayed: side effects on objects passed in (a KV cache is not updated for a reused block:
one forward reads nothing from it afterwards). ``CASTWISE_BLOCK_REUSE=0`` or :func:`disabled`
traces every block.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from castwise.trace import provenance
from castwise.trace.blocks import PLAIN, find_blocks, global_hooks, renamed, static_key, tensor_key, within
from castwise.trace.events import Event, Frame, Prov, Trace, shape_of
from castwise.trace.observers import Observer
from castwise.trace.record import Mark, Row, Stretch, renamed_event, renamed_row

if TYPE_CHECKING:
    from castwise.trace.observers import Run

_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("castwise_reuse_off", default=False)


def enabled() -> bool:
    """Whether runs reuse repeated blocks' records (on unless switched off)."""
    return not _OFF.get() and os.environ.get("CASTWISE_BLOCK_REUSE", "1") != "0"


@contextmanager
def disabled() -> Iterator[None]:
    """Runs inside this block trace every block for itself (debugging, equivalence tests)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


# -- records --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Capture:
    """A template block being traced: where its records start."""

    name: str
    mark: Mark
    branches: int
    assumed: int
    exits: list[tuple[Frame, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Out:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    prov: Prov | None
    creator: str


@dataclasses.dataclass
class _Record:
    """What a traced block produced, to stand for the blocks with its key."""

    name: str
    inputs: list[Prov | None]  # the template's input tensors' provenance, by leaf position
    params: dict[str, Prov | None]  # its parameters', buffers' and tensor attributes', by name
    outs: list[Any]  # output leaves: _Out, a plain value, or ("input", leaf index)
    spec: Any
    stretch: Stretch
    exits: list[tuple[Frame, Any]]


def _owned_tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rel, m in block.named_modules():
        for kind in (m._parameters, m._buffers, vars(m)):
            for n, t in kind.items():
                if isinstance(t, torch.Tensor) and not n.startswith("_"):
                    out[f"{rel}.{n}" if rel else n] = t
    return out


class _Mapping:
    """Provenance and names of a template's record, renamed for one block."""

    def __init__(self, rec: _Record, name: str, ins: list[Prov | None], owned: dict[str, Prov | None]) -> None:
        self.rec, self.old, self.new = rec, rec.name, name
        self.ins, self.owned = ins, owned  # this block's inputs' and tensors' provenance
        self.given: dict[int, Prov | None] = {}  # id(template prov) -> this block's prov
        for tpl, now in zip(rec.inputs, ins, strict=True):
            if tpl is not None:
                self.given.setdefault(id(tpl), now)
        for n, tpl in rec.params.items():
            if tpl is not None and n in owned:
                self.given[id(tpl)] = owned[n]
        self.memo: dict[int, Prov | None] = {}

    def to(self, rec: _Record) -> _Mapping:
        """The same block's mapping from another record of its key."""
        return self if rec is self.rec else _Mapping(rec, self.new, self.ins, self.owned)

    def prov(self, p: Prov | None) -> Prov | None:
        if p is None:
            return None
        key = id(p)
        if key in self.given:
            return self.given[key]
        if key not in self.memo:
            if within(p.module, self.old) or p.promoted:
                promoted = tuple(q for q in (self.prov(x) for x in p.promoted) if q is not None)
                self.memo[key] = dataclasses.replace(p, module=self.name(p.module), promoted=promoted)
            else:
                self.memo[key] = p
        return self.memo[key]

    def name(self, module: str) -> str:
        return renamed(module, self.old, self.new)


class _Replay(torch.autograd.Function):
    """A reused block's outputs, made from its record; backward gives each input a gradient in
    its own dtype and marks where the template's backward record goes. Every argument of
    ``apply`` is a tensor (castwise's backward walker pairs a node's results with its tensor
    edges): what else it needs is handed over in ``given``, read once by ``forward``."""

    given: tuple[BlockReuse, list[_Out], _Mapping] | None = None

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> Any:
        assert _Replay.given is not None
        ctx.reuse, outs, ctx.mapping = _Replay.given
        _Replay.given = None
        ctx.metas = [(t.shape, t.dtype, t.device, t.requires_grad) for t in tensors]
        made = [torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=o.device) for o in outs]
        ctx.mark_non_differentiable(*[t for t, o in zip(made, outs, strict=True) if not o.requires_grad])
        return tuple(made)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        reuse: BlockReuse = ctx.reuse
        return tuple(reuse.backward(ctx.mapping, ctx.metas, list(grads)))


class BlockReuse(Observer):
    """Keys, records and replays the repeated blocks of one traced run."""

    name = "reuse"
    splices = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.run: Run | None = None
        self.keys: dict[int, tuple[Any, ...]] = {}
        self.records: dict[Any, _Record | None] = {}  # call key -> the first block's record
        self.back: dict[Any, _Record | None] = {}  # call key -> the last block's (its backward's source)
        self.last: set[int] = set()  # the last block of each static key
        self.captures: list[_Capture] = []
        self.pending: list[tuple[tuple[int, int], _Mapping]] = []  # backward splices: (where, mapping)
        self.reused: dict[str, str] = {}  # block -> the template it reused

    def start(self, run: Run) -> None:
        """Key every repeated block of the model and route its calls through :meth:`call`."""
        self.run = run
        if not run.fake or not all(o.splices for o in run.observers):
            return  # an observer whose record a block's cannot stand for needs every op: none is reused
        last: dict[Any, int] = {}
        for name, block in find_blocks(self.model).items():
            key = static_key(block)
            if key is None:
                continue
            self.keys[id(block)] = key
            last[key] = id(block)
            inner = block.forward

            @functools.wraps(inner)
            def forward(*args: Any, _b: nn.Module = block, _n: str = name, _f: Any = inner, **kwargs: Any) -> Any:
                return self.call(_n, _b, _f, args, kwargs)

            block.forward = forward  # type: ignore[method-assign]  # the audit's own copy
        self.last = set(last.values())

    # -- calls ----------------------------------------------------------------------------------

    def _call_key(self, block: nn.Module, leaves: list[Any], spec: Any) -> Any:
        run = self.run
        assert run is not None
        if run.at.phase != "forward" or run.at.hook_stack or self.captures:
            return None
        if block.training and not torch.is_grad_enabled():
            # no grad in training: a reentrant checkpoint's first pass, whose backward runs the
            # block again for real; the two passes are traced as they run
            return None
        if global_hooks():
            return None  # a user's global hook runs on every module
        parts: list[Any] = []
        seen: dict[int, int] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if id(x) in run.stand.ids:
                    return None  # a dense stand-in for a nested tensor (fastpath.py): ids, not records
                # values the tracer knows (positions, a mask) may steer the block: the same values
                # (the same tensor's) or none
                known = (id(run.values.shadow.get(x)), id(run.values.recipe.get(x)))
                parts.append((tensor_key(x), seen.setdefault(id(x), i), known))
            elif isinstance(x, PLAIN) or type(x) is int:
                parts.append(("value", x))
            else:
                parts.append(("object", id(x)))
        dev = run.at.device_type
        on = torch.is_autocast_enabled(dev)
        state = (on, torch.get_autocast_dtype(dev) if on else None, torch.is_grad_enabled())
        return (self.keys[id(block)], str(spec), tuple(parts), state)

    def call(self, name: str, block: nn.Module, inner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        key = self._call_key(block, leaves, spec)
        if key is None:
            return inner(*args, **kwargs)
        if key not in self.records:
            return self._template(self.records, key, name, block, inner, args, kwargs, leaves)
        if torch.is_grad_enabled() and id(block) in self.last and key not in self.back:
            # the last block of a kind traces for itself: its backward runs before the reused
            # blocks' and gives their backward record (also when backward stops on an error)
            return self._template(self.back, key, name, block, inner, args, kwargs, leaves)
        rec = self.records[key]
        if rec is None:
            return inner(*args, **kwargs)
        return self._replay(rec, name, block, leaves)

    def _template(
        self,
        store: dict[Any, _Record | None],
        key: Any,
        name: str,
        block: nn.Module,
        inner: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
    ) -> Any:
        run = self.run
        assert run is not None
        branches = len(run.recorder.trace.branches)
        cap = _Capture(name, run.recorder.mark(), branches, run.values.assumed_now)
        store[key] = None  # until it returns: a failing template is no record
        self.captures.append(cap)
        try:
            out = inner(*args, **kwargs)
        finally:
            self.captures.pop()
        store[key] = self._record(cap, block, leaves, out)
        return out

    def _record(self, cap: _Capture, block: nn.Module, leaves: list[Any], out: Any) -> _Record | None:
        run = self.run
        assert run is not None
        trace = run.recorder.trace
        unusual = (
            len(trace.hook_changes) != cap.mark.hook_changes
            or len(trace.branches) != cap.branches
            or run.values.assumed_now != cap.assumed
            or run.at.refused is not None
            or trace.failure is not None
        )
        if unusual:
            return None
        out_leaves, spec = tree_flatten(out)
        index = {id(x): i for i, x in enumerate(leaves)}
        owned = {id(t) for t in _owned_tensors(block).values()}
        outs: list[Any] = []
        for x in out_leaves:
            if id(x) in index and not isinstance(x, torch.Tensor):
                outs.append(("input", index[id(x)]))
            elif isinstance(x, torch.Tensor):
                if id(x) in index or id(x) in owned or x in run.values.shadow or x in run.values.recipe or x.is_nested:
                    return None  # an input or weight passed through, or known values: not made here
                if isinstance(x.grad_fn, torch.autograd.function.BackwardCFunction):
                    # made by a custom Function (a reentrant checkpoint): its backward runs Python
                    # (the block again) whose ops no module name marks as the block's
                    return None
                made_in = str(run.at.creator.get(x, ""))
                outs.append(_Out(shape_of(x), x.stride(), x.dtype, x.device, x.requires_grad, run.prov_of(x), made_in))
            elif isinstance(x, PLAIN) or type(x) is int:
                outs.append(x)
            else:
                return None  # an object made in the block: it cannot be made again from a record
        return _Record(
            cap.name,
            [run.prov_of(x) if isinstance(x, torch.Tensor) else None for x in leaves],
            {n: run.prov_of(t) for n, t in _owned_tensors(block).items()},
            outs,
            spec,
            run.recorder.since(cap.mark),
            list(cap.exits),
        )

    # -- replay ---------------------------------------------------------------------------------

    def _replay(self, rec: _Record, name: str, block: nn.Module, leaves: list[Any]) -> Any:
        run = self.run
        assert run is not None
        ins = [run.prov_of(x) if isinstance(x, torch.Tensor) else None for x in leaves]
        mapping = _Mapping(rec, name, ins, {n: run.prov_of(t) for n, t in _owned_tensors(block).items()})
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        grads = [p for p in block.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
        if torch.is_grad_enabled():
            run.at.tag_outputs(tensors)  # their nodes name their makers, as an op using them would
        made_outs = [o for o in rec.outs if isinstance(o, _Out)]
        made: Any = ()
        if made_outs:
            with run.quiet():
                _Replay.given = (self, made_outs, mapping)
                made = _Replay.apply(*tensors, *grads)
        made_iter = iter(made)
        out_leaves: list[Any] = []
        for o in rec.outs:
            if isinstance(o, _Out):
                t = next(made_iter)
                prov = mapping.prov(o.prov) or provenance.replayed(name, t, forward=True)
                run.adopt(t, prov, mapping.name(o.creator))
                out_leaves.append(t)
            elif isinstance(o, tuple) and o and o[0] == "input":
                out_leaves.append(leaves[o[1]])
            else:
                out_leaves.append(o)
        self._splice(rec, mapping, block)
        self.reused[name] = rec.name
        return tree_unflatten(out_leaves, rec.spec)

    def _splice(self, rec: _Record, mapping: _Mapping, block: nn.Module) -> None:
        """The template's forward record, renamed, as if this block had run (its module exits too)."""
        run = self.run
        assert run is not None
        subs = dict(block.named_modules())

        def exits() -> None:
            for frame, output in rec.exits:
                rel = frame.name[len(rec.name) + 1 :]
                again = Frame(mapping.name(frame.name), subs.get(rel, frame.module), frame.autocast, frame.inputs)
                run.exited(again, output)

        run.recorder.splice(rec.stretch, mapping, exits)

    def backward(self, mapping: _Mapping, metas: list[Any], grads: list[Any]) -> list[Any]:
        """A reused block's input gradients (each in its input's dtype), and a mark where the
        template's backward record goes."""
        run = self.run
        assert run is not None
        self.pending.append((run.recorder.at(), mapping))
        out: list[Any] = []
        with run.quiet():
            for shape, dtype, device, needs in metas:
                out.append(torch.empty(shape, dtype=dtype, device=device) if needs else None)
        for g in out:
            if g is not None:
                # a gradient keeps the origin of the incoming one of its dtype, as a chain of
                # dtype-preserving backward ops would; else the block made it
                same = next((run.prov_of(x) for x in grads if isinstance(x, torch.Tensor) and x.dtype == g.dtype), None)
                run.adopt(g, same or provenance.replayed(mapping.new, g, forward=False))
        return out

    # -- observer hooks ---------------------------------------------------------------------------

    def module_exit(self, run: Any, frame: Frame, output: Any) -> None:
        for cap in self.captures:
            if frame.name != cap.name and within(frame.name, cap.name):
                cap.exits.append((frame, output))

    def finish(self, trace: Trace) -> None:
        """Splice the templates' backward records where the reused blocks' backward ran; name
        the reused blocks among the modules with ops no contract covers."""
        if self.pending:
            assert self.run is not None
            ops: dict[str, list[Row]] = {}
            events: dict[str, list[Event]] = {}
            places: list[tuple[tuple[int, int], list[Row], list[Event]]] = []
            for at, m in self.pending:
                key = next(k for k, r in self.records.items() if r is m.rec)
                source = self.back.get(key) or m.rec
                if source.name not in ops:
                    ops[source.name] = [r for r in trace.ops if r[2] == "backward" and within(r[0], source.name)]
                    events[source.name] = [
                        e for e in trace.events if e.phase == "backward" and within(e.module, source.name)
                    ]
                m = m.to(source)
                rows = [renamed_row(r, m) for r in ops[m.old]]
                places.append((at, rows, [renamed_event(e, m) for e in events[m.old]]))
            self.run.recorder.insert(places)
            self.pending.clear()
        for block, template in self.reused.items():
            for modules in trace.uncovered.values():
                modules.update([renamed(m, template, block) for m in modules if within(m, template)])
