"""The run record's one writer: a producer (the tracer, the graph walk), its observers and block
reuse append ops, events, coverage, bytes, upcasts and hook changes to a :class:`Trace` only
through a :class:`Recorder`, so a new field is written, and spliced for a reused block, in one
place. (The fake run's value assumptions, ``Trace.branches``/``sizes``, are the values part's:
a block that makes one is never reused.)

A stretch of the record (a block's) is marked (:meth:`Recorder.mark`), taken (:meth:`since`) and
spliced in again renamed for another block (:meth:`splice`, :meth:`insert`); the renaming is the
caller's (``trace/reuse.py``: which module and which origin of the template stands for which).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from castwise.trace.events import Compiled, Event, HookChange, Phase, Prov, Trace, Upcast, shape_of

if TYPE_CHECKING:
    import torch

    from castwise.trace.events import Frame

Row = tuple[str, str, str, tuple[Any, ...], tuple[Any, ...]]  # (module, op, phase, inputs, outputs)


class Renaming(Protocol):
    """How a template's record reads for another block: module names and origins."""

    def name(self, module: str) -> str: ...

    def prov(self, p: Prov | None) -> Prov | None: ...


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where a stretch of the record starts."""

    ops: int
    events: int
    hook_changes: int
    act: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Stretch:
    """What a stretch of the record holds: ops, events, activation bytes made in it."""

    ops: tuple[Row, ...]
    events: tuple[Event, ...]
    act: dict[str, int]


class Recorder:
    """Appends to one run's :class:`Trace`. A plain slotted object: called per op."""

    __slots__ = ("record_ops", "trace")

    def __init__(self, trace: Trace | None = None, *, record_ops: bool = True) -> None:
        self.trace = trace if trace is not None else Trace()
        self.record_ops = record_ops  # rows of every op (off: only what rules read)

    # -- writes -----------------------------------------------------------------------------------

    def op(self, module: str, name: str, phase: str, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        if self.record_ops:  # raw (dtype, shape) pairs: formatting waits until someone reads them
            ins_ = tuple([(t.dtype, shape_of(t)) for t in ins])
            self.trace.ops.append((module, name, phase, ins_, tuple([(o.dtype, shape_of(o)) for o in outs])))

    def event(self, event: Event) -> None:
        self.trace.events.append(event)

    def failure(self, event: Event) -> None:
        """The op that raised: the first one (a later raise is the same error going up)."""
        if self.trace.failure is None:
            self.trace.failure = event

    def uncovered(self, op: str, module: str) -> None:
        self.trace.uncovered.setdefault(op, set()).add(module)

    def activation(self, dtype: str, nbytes: int) -> None:
        counts = self.trace.activation_bytes
        counts[dtype] = counts.get(dtype, 0) + nbytes

    def upcast(self, upcast: Upcast) -> None:
        self.trace.upcasts.append(upcast)

    def hook_change(self, change: HookChange) -> None:
        self.trace.hook_changes.append(change)

    def raised(self, error: BaseException, stack: list[Frame], phase: Phase) -> None:
        """The model raised (the module stack at the raise)."""
        trace = self.trace
        trace.error, trace.stack, trace.error_phase, trace.status = error, stack, phase, "error"

    def ended(self, compiled: Compiled | None = None) -> None:
        """The run ended; ``compiled``: what torch.compile did in it (a compiled run)."""
        if self.trace.events:  # a refused op fails the run even where the model went on
            self.trace.status = "error"
        if compiled is not None:
            self.trace.compiled = compiled

    # -- stretches --------------------------------------------------------------------------------

    def mark(self) -> Mark:
        t = self.trace
        return Mark(len(t.ops), len(t.events), len(t.hook_changes), dict(t.activation_bytes))

    def since(self, mark: Mark) -> Stretch:
        t = self.trace
        act = {k: v - mark.act.get(k, 0) for k, v in t.activation_bytes.items() if v != mark.act.get(k, 0)}
        return Stretch(tuple(t.ops[mark.ops :]), tuple(t.events[mark.events :]), act)

    def splice(self, record: Stretch, renaming: Renaming, exits: Callable[[], None]) -> None:
        """``record``'s forward stretch renamed, as if the renamed block had run; ``exits`` replays
        its module exits to the observers, whose upcasts are renamed too."""
        trace = self.trace
        trace.ops.extend(renamed_row(r, renaming) for r in record.ops if r[2] == "forward")
        trace.events.extend(renamed_event(e, renaming) for e in record.events if e.phase == "forward")
        for k, v in record.act.items():
            self.activation(k, v)
        start = len(trace.upcasts)
        exits()
        trace.upcasts[start:] = [
            dataclasses.replace(u, module=renaming.name(u.module), prov=renaming.prov(u.prov))
            for u in trace.upcasts[start:]
        ]

    def at(self) -> tuple[int, int]:
        """Where the next op row and event go (a place to :meth:`insert` at)."""
        return len(self.trace.ops), len(self.trace.events)

    def insert(self, places: list[tuple[tuple[int, int], list[Row], list[Event]]]) -> None:
        """Rows and events placed before the positions :meth:`at` gave (in order)."""
        trace = self.trace
        trace.ops[:] = _spliced(trace.ops, [(at[0], rows) for at, rows, _e in places])
        trace.events[:] = _spliced(trace.events, [(at[1], events) for at, _r, events in places])


def renamed_row(row: Row, renaming: Renaming) -> Row:
    return (renaming.name(row[0]), *row[1:])


def renamed_event(e: Event, renaming: Renaming) -> Event:
    disabled = None if e.disabled_by is None else renaming.name(e.disabled_by)
    provs = tuple(renaming.prov(p) for p in e.provs)
    return dataclasses.replace(e, module=renaming.name(e.module), provs=provs, disabled_by=disabled)


def _spliced(items: list[Any], inserts: list[tuple[int, list[Any]]]) -> list[Any]:
    """``items`` with each insert's items placed before position ``at`` (inserts in order)."""
    out: list[Any] = []
    start = 0
    for at, more in inserts:
        out.extend(items[start:at])
        out.extend(more)
        start = at
    out.extend(items[start:])
    return out


__all__ = ["Mark", "Recorder", "Renaming", "Stretch", "renamed_event", "renamed_row"]
