"""What a traced run records: frozen values, torch-free at import.

A producer makes them: the dispatch-mode tracer (``castwise.trace.tracer``, the eager program)
or the compiled-graph walker (``castwise.trace.compiled``, the graphs torch.compile runs). The
audit's rules read only these records (and a :class:`Producer` for the tensors around a raise),
never a producer's own state, so each producer feeds the same rules; the report shows them.
They hold torch objects (dtypes, exceptions) but never import torch, so the torch-free layers
(``report``, ``lint``) can name them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from castwise._dtypes import fmt_tensor, name_of
from castwise.rules.api import HookChange as HookChange
from castwise.rules.api import Mode as Mode
from castwise.rules.api import Origin as Origin

if TYPE_CHECKING:
    import torch
    from torch import nn

    from castwise.trace.contracts import Violation

Phase = Literal["forward", "backward"]


def as_mode(mode: str) -> Mode:
    """A run mode, checked ("train" or "eval")."""
    if mode == "train":
        return "train"
    if mode == "eval":
        return "eval"
    raise ValueError(f"mode={mode!r} is not a run mode; valid: eval, train")


RunStatus = Literal["ok", "error", "incomplete"]
# which program a run records: the eager forward/backward, or the graphs torch.compile runs
RunKind = Literal["eager", "compiled"]

ProvKind = Literal["param", "buffer", "attribute", "input", "created", "cast", "autocast", "op", "backward"]


@dataclass(frozen=True)
class Prov:
    """Where a tensor's current dtype came from.

    ``kind``: ``param`` / ``buffer`` / ``attribute`` (a module's plain tensor attribute) /
    ``input`` (a model input) / ``created`` (a factory op in forward: arange, zeros...) /
    ``cast`` (an explicit ``.to``) / ``autocast`` (a cast or op autocast chose) / ``op`` (any
    other op whose result dtype differs from its inputs') / ``backward``.
    """

    kind: ProvKind
    module: str
    op: str | None
    tensor: str | None
    dtype: torch.dtype
    source: str | None = None  # "models/rope.py:42": the user's line that made it (made/cast tensors)
    # a shared Parameter (tied weights): the other modules holding it; any of them may be the one
    # the user changed (a cast through either changes both), so findings name them all
    shared: tuple[str, ...] = ()
    # an op that promoted mixed floating operands (f16 + bf16 -> f32): the operands' own origins,
    # those not in the result's dtype; the one off the run's compute dtype is the cause
    promoted: tuple[Prov, ...] = ()

    def origin(self) -> Origin:
        if self.kind == "input":  # the tensor text says it is a model input
            return Origin(None, self.op, self.tensor)
        if self.module:
            return Origin(self.module, self.op, self.tensor)
        # "" would read as a model input: say the root module made it
        return Origin(None, self.op, f"{self.tensor} at the model's top level")

    def describe(self) -> str:
        where = f"`{self.module}`" if self.module else "the model's top level"
        if self.kind in ("param", "buffer", "attribute", "input"):
            return f"{self.tensor}"
        what = {
            "created": "created by",
            "cast": "cast by",
            "autocast": "made by autocast in",
            "op": "made by",
            "backward": "made in backward by",
        }.get(self.kind, "made by")
        return f"{what} {self.op} in {where}" if self.op else f"{what} {where}"


@dataclass(frozen=True)
class Event:
    """A contract violation, or an op that raised, with the provenance of its operands."""

    phase: Phase
    module: str
    op: str
    violation: Violation | None
    error: BaseException | None
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    provs: tuple[Prov | None, ...]
    autocast: torch.dtype | None  # autocast dtype in force where the op ran, if any
    fastpath: bool
    # the module whose forward turned autocast off around this op (autocast was on at its entry,
    # and the op ran without it), if any
    disabled_by: str | None = None


@dataclass(frozen=True)
class Upcast:
    """A module turned low-precision activations into float32 outside autocast."""

    module: str
    in_dtype: torch.dtype
    prov: Prov | None
    shape: tuple[int, ...]


@dataclass
class Frame:
    name: str
    module: nn.Module
    autocast: torch.dtype | None
    inputs: list[torch.Tensor]
    entered: int = 0  # castwise's autocast blocks open at the pre-hook (``_autocast.ENTERED``)


@dataclass(frozen=True)
class GraphBreak:
    """Where Dynamo split a compiled program (the code between graphs runs eagerly)."""

    reason: str
    count: int = 1  # how often Dynamo met it during the run
    source: str | None = None  # the user's line ("model.py:42")


@dataclass(frozen=True)
class Compiled:
    """What torch.compile did during a compiled run."""

    graphs: int  # graphs Dynamo compiled (forward or inference graphs, one per region between breaks)
    backward_graphs: int
    breaks: tuple[GraphBreak, ...]
    fullgraph: bool  # the user compiled with fullgraph=True: a break is an error there
    ops: int  # aten ops checked in the graphs
    error: str | None = None  # torch.compile itself failed (the run recorded what it captured before)
    decompositions: str | None = None  # "inductor": the graphs were traced with Inductor's decompositions
    # why the backward graphs were not traced in a train run (None: they were, where there are any)
    backward_untraced: str | None = None


@dataclass
class Trace:
    """What one run recorded."""

    # (module, op, phase, inputs, outputs), inputs/outputs as (dtype, shape) pairs
    ops: list[tuple[str, str, str, tuple[Any, ...], tuple[Any, ...]]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    upcasts: list[Upcast] = field(default_factory=list)
    uncovered: dict[str, set[str]] = field(default_factory=dict)  # op -> modules
    activation_bytes: dict[str, int] = field(default_factory=dict)
    failure: Event | None = None
    error: BaseException | None = None
    stack: list[Frame] = field(default_factory=list)  # module stack when the model raised
    error_phase: Phase = "forward"
    status: RunStatus = "ok"
    hook_changes: list[HookChange] = field(default_factory=list)
    # what a fake run took for values it could not know (trace/values.py; CW903): each branch site
    # by (file, line) with its answers, and each assumed size
    branches: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    sizes: list[dict[str, Any]] = field(default_factory=list)
    modules: list[dict[str, Any]] = field(default_factory=list)  # the module tree (trace/module_tree.py)
    # what observers of one's own recorded, by observer name (castwise's own read the fields above)
    observed: dict[str, Any] = field(default_factory=dict)
    kind: RunKind = "eager"
    compiled: Compiled | None = None  # set by the compiled producer

    def rows(self) -> list[tuple[str, str, str, tuple[str, ...], tuple[str, ...]]]:
        """The recorded ops with tensors printed as ``bf16[2, 4]``."""
        return [
            (
                m,
                op,
                phase,
                tuple(fmt_tensor(name_of(d), s) for d, s in ins),
                tuple(fmt_tensor(name_of(d), s) for d, s in outs),
            )
            for m, op, phase, ins, outs in self.ops
        ]


class Producer(Protocol):
    """What a run's producer answers after the run, beyond its :class:`Trace`: the operands of a
    call that raised before any op dispatched (sdpa's own q/k/v check, a layer's Python dtype
    check), and any tensor's provenance. The dispatch-mode tracer answers all three; the compiled
    producer has no such call (Dynamo traces on fake values before anything runs) and answers
    ``refused=None``, ``recent=()``."""

    @property
    def refused(self) -> tuple[str, list[torch.Tensor]] | None: ...

    @property
    def recent(self) -> Sequence[tuple[str, torch.Tensor]]: ...

    def prov_of(self, t: torch.Tensor) -> Prov | None: ...


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """The shape, or () for a nested tensor (which has none)."""
    return () if t.is_nested else tuple(t.shape)
