"""Numerics observers on the tracer: the first op that made a NaN/Inf, and the op a rerun looks for.

Both run on real tensors (``Tracer(..., fake=False)``) and keep no activation: an op's inputs are
looked at only when its output is non-finite. The streamed value ranges forecast reads are
``castwise.numerics.ranges``.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from castwise._dtypes import low_dtypes, short_of
from castwise.trace.observers import Observer, OpCall

if TYPE_CHECKING:
    from castwise.trace.events import Trace

_LOW = low_dtypes()
# frames that are plumbing, not the user's code: the innermost frame outside them is "the user's line"
_PLUMBING = (
    "/torch/",
    "/castwise/",
    "/transformers/modeling_utils",
    "/transformers/utils/",
    "/transformers/integrations/",
    "/transformers/pytorch_utils",
    "/transformers/masking_utils",
    "/transformers/modeling_layers",
    "/transformers/generation/",
    "/lightning/",
    "/contextlib.py",
    "/functools.py",
    "/timm/layers/_fx",
    "<",
)


def user_line() -> str | None:
    """``file:line`` of the innermost stack frame outside torch, castwise and library plumbing."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if not any(p in name for p in _PLUMBING):
            return f"{frame.filename}:{frame.lineno}"
    return None


# ops whose output is uninitialised memory (overwritten next): garbage NaNs are not made values
_UNINITIALISED = frozenset(
    {
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.empty_permuted",
    }
)


def _inputs(call: OpCall) -> list[torch.Tensor]:
    """The op's floating tensor inputs: an ``out=`` tensor is a destination, not an input."""
    if "out" not in call.kwargs:
        return _floats(call.tensors)
    out = call.kwargs["out"]
    outs = out if isinstance(out, (list, tuple)) else [out]
    return _floats([t for t in call.tensors if not any(t is o for o in outs)])


def _floats(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in ts if t.is_floating_point() and not t.is_nested and t.numel()]


def _sum_is_finite(t: torch.Tensor) -> bool:
    # any NaN or Inf makes the sum NaN or Inf; a finite sum proves every element finite (the
    # accumulation runs in float32 at least, so a finite fp16 tensor does not overflow it)
    s = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    return math.isfinite(s.item())


def kinds(t: torch.Tensor) -> tuple[bool, bool]:
    """(has NaN, has +-Inf)."""
    return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


def tensor_range(t: torch.Tensor) -> dict[str, Any]:
    """absmax over the finite values, the smallest non-zero magnitude, and the non-finite counts."""
    a = t.detach().abs().float()  # float32: every floating dtype's magnitudes fit, f64 aside
    finite = torch.isfinite(a)
    fin = torch.where(finite, a, torch.zeros((), dtype=a.dtype))
    nz = torch.where(fin > 0, fin, torch.full((), math.inf, dtype=a.dtype))
    smallest = float(nz.min()) if nz.numel() else math.inf
    return {
        "tensor": f"{short_of(t.dtype)}[{', '.join(str(s) for s in t.shape)}]",
        "absmax": float(fin.max()) if fin.numel() else 0.0,
        "min_nonzero": None if math.isinf(smallest) else smallest,
        "nan": int(torch.isnan(t).sum()),
        "inf": int(torch.isinf(t).sum()),
    }


def limits(dtype: torch.dtype) -> dict[str, Any]:
    fi = torch.finfo(dtype)
    return {
        "dtype": short_of(dtype),
        "max": float(fi.max),
        "smallest_normal": float(fi.smallest_normal),
        "smallest_subnormal": float(fi.smallest_normal) * float(fi.eps),
    }


@dataclass(frozen=True)
class Producer:
    """The first op that made a NaN or Inf its inputs did not have."""

    module: str
    op: str
    phase: str
    made: str  # "nan", "inf", "nan+inf"
    out_dtype: torch.dtype
    output: dict[str, Any]
    inputs: list[dict[str, Any]]
    scalars: list[float]  # non-finite Python scalars among the arguments (a -inf fill value)
    source: str | None
    node: str | None  # the autograd node of a backward op
    index: int  # the (module, op, phase) occurrence, to find the same op in a rerun
    rerun_finite: bool | None  # the op on the same inputs in a wider dtype: finite?
    rerun_absmax: float | None
    in_place: bool


def _widen(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        # a wider dtype on the same values: the verdict's question is whether range/precision caused it
        return x.detach().to(torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32)
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64 if x in (torch.float32, torch.float64) else torch.float32
    return x


class NonfiniteObserver(Observer):
    """Finds the first op whose output holds a NaN (or Inf) that none of its inputs held.

    An Inf counts as made only when every input, tensors and scalars, was finite (so a ``-inf``
    fill value of an attention mask is not a producer); a NaN counts when no input held a NaN
    (``softmax`` over a row that is all ``-inf`` makes one). Checking stops at the first.
    """

    name = "nonfinite"

    def __init__(self) -> None:
        self.found: Producer | None = None
        # producers in forward whose values carry no gradient (position buckets, masks: T5's
        # log of a zero distance): kept, but the search goes on for one that does
        self.secondary: list[Producer] = []
        self.counts: dict[tuple[str, str, str], int] = {}
        self._pre: tuple[OpCall, list[tuple[bool, bool]]] | None = None
        self.ops_checked = 0

    def check(self, call: OpCall) -> None:
        # an in-place op overwrites its inputs: look at them before it runs
        if self.found is None and call.func._schema.is_mutable:
            self._pre = (call, [kinds(t) for t in _inputs(call)])
        return None

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        if self.found is not None:
            return
        key = (call.module, call.name, call.phase)
        index = self.counts.get(key, 0)
        self.counts[key] = index + 1
        if call.func.is_view or call.name in _UNINITIALISED:
            return  # a view shows its base's values; empty memory holds no computed value
        outs = _floats(outputs)
        self.ops_checked += 1
        if not outs or all(_sum_is_finite(o) for o in outs):
            return
        out_nan = out_inf = False
        for o in outs:
            n, i = kinds(o)
            out_nan, out_inf = out_nan or n, out_inf or i
        pre = self._pre
        in_kinds = pre[1] if pre is not None and pre[0] is call else [kinds(t) for t in _inputs(call)]
        self._pre = None
        scalars = [
            float(x) for x in (*call.args, *call.kwargs.values()) if isinstance(x, float) and not math.isfinite(x)
        ]
        in_nan = any(n for n, _ in in_kinds) or any(math.isnan(s) for s in scalars)
        in_nonfinite = in_nan or any(i for _, i in in_kinds) or bool(scalars)
        made_nan = out_nan and not in_nan
        made_inf = out_inf and not in_nonfinite
        if not (made_nan or made_inf):
            return
        producer = self._producer(call, outs, index, made_nan, made_inf, scalars)
        if call.phase == "forward" and torch.is_grad_enabled() and not any(t.requires_grad for t in _inputs(call)):
            if len(self.secondary) < 8:
                self.secondary.append(producer)
            return
        self.found = producer

    @property
    def best(self) -> Producer | None:
        """The first producer whose values carry a gradient, else the first at all."""
        return self.found or (self.secondary[0] if self.secondary else None)

    def _producer(
        self, call: OpCall, outs: list[torch.Tensor], index: int, made_nan: bool, made_inf: bool, scalars: list[float]
    ) -> Producer:
        in_place = bool(call.func._schema.is_mutable)
        rerun_finite: bool | None = None
        rerun_absmax: float | None = None
        if not in_place and outs[0].dtype in _LOW:  # an in-place op's inputs are gone: the whole-run rerun decides
            try:
                args, kwargs = tree_map(_widen, (call.args, call.kwargs))
                wide = call.func(*args, **kwargs)
                wides = _floats(
                    [wide] if isinstance(wide, torch.Tensor) else [w for w in wide if isinstance(w, torch.Tensor)]
                )
                rerun_finite = all(bool(torch.isfinite(w).all()) for w in wides)
                rerun_absmax = max((float(w.abs().max()) for w in wides if w.numel()), default=0.0)
            except Exception:  # an op without a wider kernel: the whole-run rerun decides
                rerun_finite = None
        n = call.backward_node()
        node = n.name() if n is not None else None
        made = "nan+inf" if made_nan and made_inf else "nan" if made_nan else "inf"
        return Producer(
            module=call.module,
            op=call.name,
            phase=call.phase,
            made=made,
            out_dtype=outs[0].dtype,
            output=tensor_range(outs[0]),
            inputs=[tensor_range(t) for t in _inputs(call)],
            scalars=scalars,
            source=user_line() if call.phase == "forward" else None,
            node=node,
            index=index,
            rerun_finite=rerun_finite,
            rerun_absmax=rerun_absmax,
            in_place=in_place,
        )

    def finish(self, trace: Trace) -> None:
        trace.observed[self.name] = self.best


class OpFinder(Observer):
    """In a rerun: whether the ``index``-th ``op`` of ``module`` in ``phase`` made non-finite values."""

    name = "op_finder"

    def __init__(self, module: str, op: str, phase: str, index: int) -> None:
        self.want = (module, op, phase)
        self.index = index
        self.seen = 0
        self.finite: bool | None = None
        self.absmax: float | None = None

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        if self.finite is not None or (call.module, call.name, call.phase) != self.want:
            return
        if self.seen == self.index:
            outs = _floats(outputs)
            self.finite = all(bool(torch.isfinite(o).all()) for o in outs)
            self.absmax = max((float(o.abs().max()) for o in outs if o.numel()), default=0.0)
        self.seen += 1
