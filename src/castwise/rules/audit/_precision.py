"""Silent precision loss: what the precision observer records and what the CW14x rules share.

The observer (``castwise.trace.precision``) records plain values here while the model runs; the
rules (CW120's containment, CW140-CW142) read them from ``trace.observed[NAME]`` and group them
into one finding per origin chain. Torch-free at import: dtypes are only held, never made.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from castwise._dtypes import name_of, short_of
from castwise.rules.api import Origin, ProvLike
from castwise.rules.audit._text import generalize

if TYPE_CHECKING:
    import torch

    from castwise.rules.api import RunLike, Session

NAME = "precision"  # the observer's name: its record is trace.observed[NAME]

# the bits of the significand each 16-bit dtype stores (spacing of [1, 2) is 2**-bits)
_BITS = {"bfloat16": 7, "float16": 10}


@dataclass(frozen=True)
class LowOp:
    """An op autocast runs in float32 on the target, run with a 16-bit input outside autocast."""

    op: str  # "aten._log_softmax"
    module: str  # where it ran
    dtype: torch.dtype  # the 16-bit input's dtype
    shape: tuple[int, ...]  # that input's shape
    prov: ProvLike | None  # where the input's dtype came from
    magnitude: float  # the estimated size of the values the op makes (a loss, log-probabilities)
    made_by: str | None = None  # the module whose op computed the 16-bit input (through views)


@dataclass(frozen=True)
class Rounding:
    """Where positions (a position grid, a running count, position ids, a timestep) became 16-bit."""

    op: str | None  # the op that computed them in 16-bit ("aten.cumsum"), None for a cast or an input
    module: str  # where that happened
    dtype: torch.dtype
    prov: ProvLike | None  # the cast, the input cast, or the 16-bit operand of the computing op
    magnitude: float  # the largest |position| where rounded (known values, else the largest index)
    # the factor the positions were multiplied by after the rounding (a timestep in [0, 1] times
    # FLUX's time_factor 1000): the rounding error grows with it
    scale: float = 1.0
    again: bool = False  # the scaled positions were computed in 16-bit too: rounded at their new size

    @property
    def step(self) -> float:
        """The distance between neighbouring positions the phases can still tell apart."""
        step = spacing(self.magnitude, self.dtype) * self.scale
        return max(step, spacing(self.largest, self.dtype)) if self.again else step

    @property
    def largest(self) -> float:
        """The largest |position| the phases are made of (after the scale)."""
        return self.magnitude * self.scale


@dataclass(frozen=True)
class Narrowed:
    """Positions rounded to 16-bit, then multiplied with a frequency table into phases that a
    sin/cos/exp/polar reads (CW141)."""

    op: str  # the phase op: "aten.mul", "aten.bmm"
    module: str  # where the phase was computed
    reads: str  # what reads the phase: "aten.cos"
    rounding: Rounding


# what made the values of a Decision taken on a matmul's 16-bit output itself (router logits)
LOGITS = "a matmul (logits)"


@dataclass(frozen=True)
class Decision:
    """A choice (top-k, argmax, sort, a comparison) taken on 16-bit probabilities or scores."""

    op: str  # "aten.topk"
    module: str
    dtype: torch.dtype
    made_by: str  # "softmax", "sigmoid" or "an added 16-bit buffer"
    prov: ProvLike | None
    width: int  # the number of choices compared (the last dimension)


@dataclass(frozen=True)
class Accumulation:
    """A 16-bit tensor accumulated into over ``count`` contributions (CW143): a python-loop chain
    of adds in one module, an ``index_add_`` / ``scatter_add_`` / accumulating ``index_put_`` with
    many contributions per slot, or a ``cumsum`` whose kernel adds in the 16-bit dtype."""

    op: str  # "aten.add", "aten.index_add_", "aten.cumsum"
    module: str  # where the accumulation ran
    dtype: torch.dtype  # the accumulator's
    shape: tuple[int, ...]  # the accumulator's shape
    count: int  # contributions per element (the longest chain; the mean per slot for a scatter)
    prov: ProvLike | None  # where the accumulator's dtype came from
    line: str | None  # the user's line that accumulates ("models/norm.py:42"), when recorded
    known: bool = False  # ``count`` read from index values the run knows (else estimated from shapes)


@dataclass(frozen=True)
class PrecisionRecord:
    """What one run recorded of precision loss."""

    contained: frozenset[str] = frozenset()  # up-cast modules whose float32 fed only losses/softmax/norms/reductions
    spread: frozenset[str] = frozenset()  # up-cast modules whose float32 reached other computation
    low_ops: tuple[LowOp, ...] = ()
    narrowed: tuple[Narrowed, ...] = ()
    decisions: tuple[Decision, ...] = ()
    accumulations: tuple[Accumulation, ...] = ()


def records(session: Session) -> Iterator[tuple[RunLike, PrecisionRecord]]:
    """Each run's precision record (runs a producer without the observer recorded have none)."""
    for r in session.runs:
        found = r.trace.observed.get(NAME)
        if isinstance(found, PrecisionRecord):
            yield r, found


def declared(run: RunLike, *modules: str | None) -> bool:
    """Whether the user's policy names one of ``modules`` with a 16-bit clause (``out[lm_head]=bf16``,
    ``keep[router]=bf16``): precision declared there on purpose, which the CW14x rules respect. A
    whole-model preset (``bf16-true``) declares nothing: bf16 cross-entropy under it is the bug."""
    return any(m is not None and m in run.declared for m in modules)


def spacing(magnitude: float, dtype: torch.dtype) -> float:
    """The distance between neighbouring ``dtype`` values at ``magnitude`` (the rounding error is
    half of it); NaN for a NaN / infinite magnitude, which has no spacing (no threshold holds)."""
    if not math.isfinite(magnitude):
        return math.nan
    bits = _BITS.get(name_of(dtype), 23)
    m = max(abs(magnitude), 2.0**-14)
    return float(2.0 ** (math.floor(math.log2(m)) - bits))


# an accumulation is reported from this many contributions on: a chain of n roundings is off by up
# to n/2 spacings (same-sign addends), and even random-sign roundings add like sqrt(n): from 16 on
# that is 4x one rounding of the result, what accumulating in float32 and rounding once costs
MIN_CONTRIBUTIONS = 16


def stall_count(dtype: torch.dtype) -> int:
    """How many equal addends a ``dtype`` sum takes before the next one is lost (bf16: 256)."""
    return int(2 ** (_BITS.get(name_of(dtype), 23) + 1))


def accumulated_error(count: int, dtype: torch.dtype) -> tuple[float, float]:
    """(about, worst): the relative error of a sum of ``count`` positive addends accumulated in
    ``dtype``. Each add rounds the running sum to its spacing, independent roundings adding like
    sqrt(count) (about 2^-bits x sqrt(count) / 3); once the sum is 2^(bits+1) addends large (bf16:
    256) an addend of the mean size is under half a spacing and is lost, so the sum stalls: equal
    addends (a count of ones) lose 1 - 2^(bits+1) / count, addends of varied sizes about half that.
    Measured on this CPU for bf16 loops of uniform, chi-square and exponential addends (16 to 1024
    of them): the largest error of 64 rows within 0.5x-2x of ``about``, ones at ``worst``."""
    bits = _BITS.get(name_of(dtype), 23)
    stall = stall_count(dtype)
    walk = 2.0**-bits * math.sqrt(count) / 3
    worst = 1.0 - stall / count if count > stall else walk
    return max(walk, worst / 2), max(walk, worst)


def fmt(x: float) -> str:
    return f"{x:.2g}" if x < 0.01 or x >= 1000 else f"{x:.3g}"


def chain_key(module: str, prov: ProvLike | None) -> tuple[str, str]:
    """One finding per origin chain: blocks.0 and blocks.1 count as one."""
    if prov is None:
        return (generalize(module), "")
    return (generalize(prov.module), generalize(prov.tensor or prov.op or prov.kind))


def origin_of(prov: ProvLike | None) -> Origin | None:
    return prov.origin() if prov is not None else None


def where_from(prov: ProvLike | None, dtype: torch.dtype) -> str:
    """Where the 16-bit came from, in words (the line too, when recorded)."""
    if prov is None:
        return f"{short_of(dtype)} from an unrecorded origin"
    what = prov.describe()
    line = f" ({prov.source})" if prov.source else ""
    if prov.kind in ("param", "buffer"):
        return f"{what}, stored in {short_of(dtype)} by the policy or the engine{line}"
    if prov.kind == "input":
        return f"{what}, given in {short_of(dtype)}{line}"
    return f"{what}{line}"


def modes_of(found: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(m for m in ("train", "eval") if m in found)


def short_op(op: str) -> str:
    """``aten._log_softmax`` -> ``log_softmax``, ``aten.nll_loss_forward`` -> ``nll_loss``."""
    name = op.rsplit(".", 1)[-1].lstrip("_")
    return name.removesuffix("_forward")
