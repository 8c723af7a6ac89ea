"""The range observer (forecast): every floating output streamed into per-module maxima and
power-of-two histograms, and per op its output's magnitude against its inputs'.

Nothing is kept: each output is reduced as it is made (``_deferred.Magnitudes``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from castwise.numerics._deferred import Magnitudes, nan_max
from castwise.numerics.observe import _UNINITIALISED, _floats
from castwise.trace.observers import _CASTS, Observer, OpCall

if TYPE_CHECKING:
    from castwise.trace.events import Trace

# a dtype's own largest value: what a finfo(dtype).min/max mask fill writes; float64 from
# float32's (a float32 fill written into a float64 tensor, as forecast's float64 run does)
_SENTINEL = {d: float(torch.finfo(d).max) for d in (torch.float32, torch.float16, torch.bfloat16)}
_SENTINEL[torch.float64] = _SENTINEL[torch.float32]
HIST_LO = -160  # log2 of the smallest magnitude binned (below float32's smallest subnormal, 2**-149)
HIST_HI = 130  # above float32's largest finite value (2**128)
HIST_BINS = HIST_HI - HIST_LO  # one bin per power of two: bin i holds [2**(LO+i), 2**(LO+i+1))


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
        low: frozenset[torch.dtype] = frozenset(),
    ) -> None:
        from castwise.trace.attrmap import AttrMap

        self.gemm = gemm
        # the dtypes that stand for the target in this run (forecast's stand-in run: float64 for
        # float16, see forecast.stand_in); empty: every op is judged as the target's
        self.low = low
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

    def _is_wide(self, t: torch.Tensor) -> bool:
        """A tensor the target run holds in a wider dtype than the target (the model's own upcast,
        a ``dtype=`` argument, a tensor made in the default dtype)."""
        return bool(self.low) and t.dtype not in self.low

    def _in_of(self, t: torch.Tensor, backward: bool) -> int:
        """What an op's input brings: a target-dtype tensor its magnitude (forward) or lineage
        (backward); a wide one the largest target-dtype value that went into it (its own values
        may pass the limit: they are float32 in the target run), nothing when none did."""
        if self._is_wide(t):
            got: int | None = (self.reach.get(t) if backward else None) or self.amax.get(t)
            return self._zero if got is None else got
        return self._reach_of(t) if backward else self._absmax_of(t)

    def _computes_wide(self, call: OpCall, outs: list[torch.Tensor]) -> bool:
        """Whether the target run computes and stores this op's result wider than the target: its
        output dtype is not the target's (an upcast, a ``dtype=`` reduction accumulating and
        returning float32), or, a new tensor, one of its non-scalar inputs is wider (type
        promotion: float16 with float32 gives float32; a 0-d tensor does not promote). A cast
        (``_to_copy``) and an in-place op keep the dtype they write: judged by their output.
        Reductions need no list: torch's kernels accumulate 16-bit inputs in float
        (``ATen/AccumulateType.h``: ``CPU_ACC_TYPE(Half, float)``, ``CUDA_ACC_TYPE(Half, float)``)
        and only store the result in the output dtype, which is what is judged."""
        if not self.low:
            return False
        if any(o.dtype not in self.low for o in outs):
            return True
        if call.func._schema.is_mutable or call.name in _CASTS:
            return False
        return any(t.dim() and self._is_wide(t) for t in _floats(call.tensors))

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
        ins = [self._in_of(t, backward) for t in _floats(call.tensors)]
        in_amax = self.mags.max(ins) if ins else self._zero
        # a wide op (float32 in the target run) is no site; its outputs carry what went in, so
        # that the cast back to the target dtype is judged on what entered the wide region
        computes_wide = self._computes_wide(call, outs)
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
            self.amax[o] = in_amax if computes_wide else amax
            if inside_wide:
                self.wide_out[o] = (call.module, call.name, call.phase, amax, in_amax)
            if backward:
                self.reach[o] = in_amax if inside_wide or computes_wide else self.mags.max([in_amax, amax])
            mr.maxes.append(amax)
            mr.ops += 1
            if inside_wide or in_kernel or computes_wide:
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
