"""Numerics observers on the tracer: the first op that made a NaN/Inf, and streamed value ranges.

Both run on real tensors (``Tracer(..., fake=False)``). Neither keeps an activation: the first
only looks at an op's inputs when its output is non-finite, the second reduces each output to a
maximum and a histogram of powers of two as it is made.
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from castwise._dtypes import low_dtypes, short_of
from castwise.numerics._deferred import Magnitudes, nan_max
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
# a dtype's own largest value: what a finfo(dtype).min/max mask fill writes
_SENTINEL = {d: float(torch.finfo(d).max) for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
HIST_LO = -160  # log2 of the smallest magnitude binned (below float32's smallest subnormal, 2**-149)
HIST_HI = 130  # above float32's largest finite value (2**128)
HIST_BINS = HIST_HI - HIST_LO  # one bin per power of two: bin i holds [2**(LO+i), 2**(LO+i+1))


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


# -- ranges (forecast) ---------------------------------------------------------------------------


@dataclass
class ModuleRange:
    """What one module's ops made in one phase: the largest magnitude and a power-of-two histogram.

    A small output's magnitudes are reduced in batches (``_deferred.Magnitudes``): the module's
    maximum is known once the observer resolves them (``absmax``, a float, then)."""

    maxes: list[int] = field(default_factory=list)  # its ops' absmax handles
    absmax: float = 0.0
    _hist: torch.Tensor | None = None
    ops: int = 0

    def add(self, hist: torch.Tensor | None, magnitudes: None = None) -> None:
        if hist is not None:
            self._hist = hist if self._hist is None else self._hist + hist

    @property
    def hist(self) -> torch.Tensor:
        return self._hist if self._hist is not None else torch.zeros(HIST_BINS)


@dataclass
class RangeRecord:
    """Per module and phase: ranges; per op: its output's absmax and its inputs' largest absmax
    (floats, once the run finished)."""

    modules: dict[tuple[str, str], ModuleRange] = field(default_factory=dict)
    op_keys: list[tuple[str, str, str]] = field(default_factory=list)  # (module, op, phase)
    op_out: list[float] = field(default_factory=list)
    op_in: list[float] = field(default_factory=list)
    # float8: per Linear, its GEMM operands (input, weight, grad_output) scored per recipe, and tokens
    operands: dict[str, dict[str, Any]] = field(default_factory=dict)


SAMPLE = 1 << 14  # elements per tensor the histogram looks at (strided: the shares are estimates)


def _sample(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Up to SAMPLE magnitudes of ``t`` in float32 (a strided view: no copy of the whole tensor),
    and how many elements each stands for."""
    flat = t.detach().reshape(-1)
    step = max(flat.numel() // SAMPLE, 1)
    # float32: frexp and the comparisons below want one dtype; every 16-bit magnitude fits
    return flat[::step].abs().float(), step


def absmax(t: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude below the dtype's own limit, as a 0-d float32 tensor: one
    pass (aminmax, no temporary) when no Inf or limit value (a mask fill) is present; else from
    the sample, with those values left out (in the target they are its own -inf / finfo.min)."""
    lo, hi = torch.aminmax(t.detach())
    raw = torch.maximum(-lo, hi).float()
    sentinel = _SENTINEL.get(t.dtype, math.inf)
    if t.numel() <= SAMPLE:
        a = t.detach().abs().float()
        return torch.where(a < sentinel, a, 0.0).amax()
    sa, _ = _sample(t)
    return torch.where(raw < sentinel, raw, torch.where(sa < sentinel, sa, 0.0).amax())


HIST_SAMPLE = 1 << 10  # a small tensor's magnitudes binned for the histogram (strided, weighted)


def log2_hist(sa: torch.Tensor, weight: int) -> torch.Tensor:
    """Counts of non-zero finite magnitudes per power of two, bin i holding [2**(LO+i), 2**(LO+i+1))
    (zeros, NaN and Inf are left out), each sampled element counting ``weight``."""
    _, e = torch.frexp(sa)  # sa = m * 2**e with m in [0.5, 1): sa in [2**(e-1), 2**e)
    idx = (e.long() - 1 - HIST_LO).clamp_(0, HIST_BINS - 1)
    idx = torch.where((sa > 0) & (sa < math.inf), idx, HIST_BINS)  # a dump bin, dropped below
    return torch.bincount(idx, minlength=HIST_BINS + 1)[:HIST_BINS].float() * weight


_NORM_KERNELS = ("rms_norm", "layer_norm", "group_norm", "batch_norm", "instance_norm")
_norm_codes: frozenset[Any] | None = None


def in_norm_kernel(depth: int = 40) -> bool:
    """Whether the op now dispatched was issued by one of torch's functional norms (its kernel
    accumulates in float32 whatever the tensors' dtype), found on the Python stack."""
    global _norm_codes
    if _norm_codes is None:
        fn = torch.nn.functional
        _norm_codes = frozenset(getattr(fn, n).__code__ for n in _NORM_KERNELS if hasattr(getattr(fn, n), "__code__"))
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in _norm_codes:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class RangeObserver(Observer):
    """Streams every floating output (forward and backward) into per-module maxima and histograms,
    and per op its output's absmax against its inputs' (an overflow *origin* is an op whose
    output passes a limit its inputs are within).

    ``scaled_limit``: for float8, (the target's float8 dtype name, log2 of half its smallest
    subnormal): every Linear's GEMM operands (input, weight, grad_output) are scored under each
    float8 recipe's scaling (``castwise.float8.score.scores``), which the leave-out list judges.
    ``gemm``: (the target recipe's scaling, its forward and gradient float8 dtypes): each GEMM
    of every Linear (forward, and in backward grad_input and grad_weight) scored by the error its
    result features get (``castwise.float8.score.lost``), under that recipe only.
    """

    name = "ranges"
    needs: frozenset[str] = frozenset()  # no provenance: its per-op cost stays the tracer's own

    def __init__(
        self,
        fixed: dict[int, torch.Tensor],
        scaled_limit: tuple[str, float] | None = None,
        wide: frozenset[str] = frozenset(),
        gemm: tuple[str, str, str] | None = None,
    ) -> None:
        from castwise.trace.attrmap import AttrMap

        self.gemm = gemm
        self.fixed = fixed  # id(parameter or buffer) -> absmax, computed once before the run
        self.amax = AttrMap("amax")
        # backward only: the largest magnitude in a gradient's lineage. A gradient grows and
        # shrinks linearly along the chain (no norm brings it back), so one that passed the limit
        # inflates every gradient computed from it: those are not sites of their own
        self.reach = AttrMap("reach")
        self.rec = RangeRecord()
        self.scaled_limit = scaled_limit
        self.wide = wide  # modules that compute in float32 inside: their intermediates are no sites
        # a tensor a wide module made: (module, op, phase, its absmax, its inputs' absmax). When an op
        # of another module reads it, it left the module in the target dtype: its magnitude counts
        # there (an origin of that module when it passes the limit), forward and backward alike
        self.wide_out = AttrMap("wide_out")
        self.paused = False  # a layerwise run's recomputed forward: its values are recorded already
        # magnitudes are handles, resolved in batches at finish: per op, (key, out, in) handles
        self.mags = Magnitudes(HIST_SAMPLE, HIST_LO, HIST_BINS)
        self._zero = self.mags.known(torch.zeros(()))
        self._fixed: dict[int, int] = {}  # id(parameter or buffer) -> its absmax handle
        self._ops: list[tuple[tuple[str, str, str], int, int]] = []

    def _absmax_of(self, t: torch.Tensor) -> int:
        got: int | None = self._fixed.get(id(t))
        if got is None:
            got = self.amax.get(t)
        if got is None:
            fixed = self.fixed.get(id(t))
            if fixed is not None:  # a parameter's: its handle kept here, nothing written on the user's tensor
                got = self._fixed[id(t)] = self.mags.known(fixed)
                return got
            got = self.mags.known(absmax(t) if t.numel() else torch.zeros(()))
            self.amax[t] = got
        return got

    def _reach_of(self, t: torch.Tensor) -> int:
        got: int | None = self.reach.get(t)
        return self._absmax_of(t) if got is None else got

    def _escaped(self, call: OpCall) -> None:
        """Tensors a wide module made that an op of another module reads now: their values leave
        that module stored in the target dtype, so they count as that module's op outputs."""
        for t in call.tensors:
            made = self.wide_out.get(t)
            if made is None or made[0] == call.module:
                continue
            module, op, phase, amax, in_amax = made
            self.wide_out[t] = None
            self._ops.append(((module, op, phase), amax, in_amax))
            if phase == "backward":
                self.reach[t] = self.mags.max([self._reach_of(t), amax])

    def _magnitude(self, o: torch.Tensor, mr: ModuleRange) -> int:
        """``o``'s absmax handle; its histogram goes to ``mr`` (a small output's after the run)."""
        if o.numel() <= SAMPLE:
            return self.mags.copy(o, _SENTINEL.get(o.dtype, math.inf), mr)
        sa, step = _sample(o)
        mr.add(log2_hist(sa, step))
        return self.mags.known(absmax(o))

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        if self.paused:
            return
        if self.wide:
            self._escaped(call)
        outs = _floats(outputs)
        if not outs or call.name in _UNINITIALISED:  # empty memory: garbage, not a magnitude
            return
        if call.func.is_view:
            if call.tensors:
                base = self._absmax_of(call.tensors[0])
                made = self.wide_out.get(call.tensors[0])
                reach = self.reach.get(call.tensors[0])
                for o in outs:
                    self.amax[o] = base  # a view's values are within its base's
                    if reach is not None:
                        self.reach[o] = reach
                    if made is not None:
                        self.wide_out[o] = made
            return
        # forward: each op judged on its own inputs' magnitudes, as if every site upstream were
        # fixed (an input past the limit is an upstream site's, or a parameter's: reported there);
        # backward: on its inputs' lineage (see reach)
        backward = call.phase == "backward"
        of = self._reach_of if backward else self._absmax_of
        ins = [of(t) for t in _floats(call.tensors)]
        in_amax = self.mags.max(ins) if ins else self._zero
        inside_wide = call.module in self.wide
        # a square inside torch's own norm kernels (the composite rms_norm runs as pow, mean,
        # rsqrt on some devices) is computed in float32 there: not a site; a hand-written one is
        in_kernel = call.name == "aten.pow" and in_norm_kernel()
        key = (call.module, call.phase)
        mr = self.rec.modules.get(key)
        if mr is None:
            mr = self.rec.modules[key] = ModuleRange()
        for o in outs:
            amax = self._magnitude(o, mr)
            self.amax[o] = amax
            if inside_wide:
                self.wide_out[o] = (call.module, call.name, call.phase, amax, in_amax)
            if backward:
                self.reach[o] = in_amax if inside_wide else self.mags.max([in_amax, amax])
            mr.maxes.append(amax)
            mr.ops += 1
            if inside_wide or in_kernel:
                continue  # its intermediates are float32 in the target run: only what leaves counts
            self._ops.append(((call.module, call.name, call.phase), amax, in_amax))

    def module_exit(self, run: Any, frame: Any, output: Any) -> None:
        if self.paused or self.scaled_limit is None or not isinstance(frame.module, torch.nn.Linear):
            return
        operands = self.rec.operands.setdefault(frame.name, {})
        x = frame.inputs[0].detach() if frame.inputs else None
        weight = frame.module.weight.detach()
        with self._untraced():
            for what, t in (("input", x), ("weight", weight)):
                if t is not None and what not in operands:
                    operands[what] = self._scores(t)
            if x is not None:
                tokens = x.numel() // max(x.shape[-1], 1)
                operands.setdefault("tokens", tokens)
                # the weight gradient's GEMM reads the input in backward: kept (autograd keeps it too)
                x = x.reshape(tokens, -1) if self.gemm is not None and x.numel() else None
            if x is not None and "gemm_forward" not in operands:
                operands["gemm_forward"] = self._gemm(x, weight.t(), 1, rows=False)
        out = output if isinstance(output, torch.Tensor) else None
        if out is not None and out.requires_grad and "grad_output" not in operands:
            version = None if x is None else x._version  # unless something wrote to it since

            def grad_hook(g: torch.Tensor) -> None:
                with self._untraced():
                    g = g.detach()
                    operands.setdefault("grad_output", self._scores(g))
                    if self.gemm is None or not g.numel() or "gemm_grad_input" in operands:
                        return
                    g2 = g.reshape(-1, g.shape[-1])
                    operands["gemm_grad_input"] = self._gemm(g2, weight, 2, rows=False)
                    if x is not None and x._version == version and x.shape[0] == g2.shape[0]:
                        operands["gemm_grad_weight"] = self._gemm(g2.t(), x, 2)

            out.register_hook(grad_hook)  # type: ignore[no-untyped-call]

    @contextmanager
    def _untraced(self) -> Iterator[None]:
        """The scoring's own ops: not the model's (paused), and run on the real tensors outside
        the tracer (forecast's run is never fake), so they cost what they compute."""
        was, self.paused = self.paused, True
        try:
            with torch.no_grad(), _disable_current_modes():
                yield
        finally:
            self.paused = was

    def _scores(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        from castwise.float8.score import scores

        assert self.scaled_limit is not None
        return scores(t, *self.scaled_limit)

    def _gemm(self, a: torch.Tensor, b: torch.Tensor, first: int, rows: bool = True) -> dict[str, torch.Tensor]:
        """``float8.score.lost`` of ``a @ b`` under the target recipe (``first``: which of its
        dtypes a takes, 1 forward, 2 gradient; b, the input or the weight, takes the forward's;
        ``rows``: the result's rows are features, only the weight gradient's)."""
        from castwise.float8.score import lost

        assert self.gemm is not None
        return lost(a, b, self.gemm[0], (self.gemm[first], self.gemm[1]), rows=rows)

    def finish(self, trace: Trace) -> None:
        """Resolve the run's magnitudes into the record (again after a later run: layerwise)."""
        self.mags.resolve()
        value, rec = self.mags.value, self.rec
        for key, out, in_ in self._ops:
            rec.op_keys.append(key)
            rec.op_out.append(value(out))
            rec.op_in.append(value(in_))
        self._ops = []
        for mr in rec.modules.values():
            if mr.maxes:
                mr.absmax = nan_max([value(h) for h in mr.maxes])
        trace.observed[self.name] = self.rec
