"""Magnitudes a range observer needs per op, reduced in batches instead of per op.

On a small model an op's own kernel costs about as much as one more small kernel, so an observer
that reduces each output as it is made (absolute value, mask-fill exclusion, maximum, a sample
for the histogram) costs several ops per op. Here a small output costs one copy into a chunk
buffer; the chunk is reduced in a handful of batched ops when it fills or the run ends, and the
maxima that combine outputs (an op's inputs, a module's ops) are plain floats after that.

Every magnitude is an ``int`` handle: a known 0-d tensor, a slice of the chunk, or the largest of
other handles (always made before it, so one pass in order resolves them).
"""

from __future__ import annotations

import math
from typing import Any

import torch

CHUNK = 1 << 20  # elements (4 MiB of float32) copied before a chunk is reduced


def nan_max(values: list[float]) -> float:
    """The largest value, NaN if any is NaN (as a chain of ``torch.maximum`` gives)."""
    top = -math.inf
    for v in values:
        if v != v:
            return math.nan
        top = v if v > top else top
    return top


def bin_rows(
    a: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None, n_rows: int, lo: int, bins: int
) -> torch.Tensor:
    """Per row, counts of ``a``'s non-zero finite magnitudes per power of two (bin i holds
    [2**(lo+i), 2**(lo+i+1))), one bincount for every row: ``rows`` is each element's row."""
    width = bins + 1
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): a in [2**(e-1), 2**e)
    idx = e.long().sub_(1 + lo).clamp_(0, bins - 1)  # in place: each pass is over every element
    idx = torch.where((a > 0) & (a < math.inf), idx, bins).add_(rows * width)  # a dump bin, dropped
    counts = torch.bincount(idx, weights, minlength=n_rows * width).reshape(n_rows, width)
    return counts[:, :bins].float()


class Magnitudes:
    """Handles to magnitudes, resolved to floats by :meth:`resolve` (``value``)."""

    def __init__(self, sample: int, lo: int, bins: int) -> None:
        self.sample, self.lo, self.bins = sample, lo, bins  # the histogram's sample size and bins
        self.values: list[float | None] = []
        self._tensors: list[tuple[int, torch.Tensor]] = []
        self._maxes: list[tuple[int, tuple[int, ...]]] = []
        self._buf: torch.Tensor | None = None
        self._used = 0
        # per slice of the chunk: (handle, offset, length, the dtype's limit value, histogram sink)
        self._slices: list[tuple[int, int, int, float, Any]] = []

    def _new(self) -> int:
        self.values.append(None)
        return len(self.values) - 1

    def known(self, t: torch.Tensor) -> int:
        h = self._new()
        self._tensors.append((h, t))
        return h

    def max(self, handles: list[int]) -> int:
        if len(handles) == 1:
            return handles[0]
        h = self._new()
        self._maxes.append((h, tuple(handles)))
        return h

    def copy(self, t: torch.Tensor, sentinel: float, sink: Any) -> int:
        """The largest magnitude of ``t`` below ``sentinel`` (its dtype's limit: a mask fill), and
        a strided sample of its magnitudes for ``sink.add(hist, None)``, both once the chunk is
        reduced. ``t`` is copied (in float32): an in-place op after this one changes nothing."""
        n = t.numel()
        buf = self._buf
        if buf is None or self._used + n > buf.numel() or buf.device != t.device:
            self.flush()
            buf = self._buf = torch.empty(max(CHUNK, n), device=t.device)
        h = self._new()
        buf.narrow(0, self._used, n).copy_(t.detach().reshape(-1))
        self._slices.append((h, self._used, n, sentinel, sink))
        self._used += n
        return h

    def flush(self) -> None:
        """Reduce the chunk: every slice's maximum (limit values left out) and histogram."""
        if not self._slices:
            return
        assert self._buf is not None  # slices live in it
        slices, self._slices, used, self._used = self._slices, [], self._used, 0
        dev = self._buf.device
        a = self._buf[:used].abs_()
        lengths = torch.tensor([s[2] for s in slices], device=dev)
        limit = torch.repeat_interleave(torch.tensor([s[3] for s in slices], device=dev), lengths)
        tops = torch.segment_reduce(torch.where(a < limit, a, 0.0), "max", lengths=lengths).tolist()
        for (h, *_), top in zip(slices, tops, strict=True):
            self.values[h] = top
        self._bin(a, slices, dev)

    def _bin(self, a: torch.Tensor, slices: list[tuple[int, int, int, float, Any]], dev: Any) -> None:
        """Each slice's strided sample (at most ``sample`` elements, each standing for ``step``)
        binned into its sink's row: the sample indices built in batched ops, not per slice."""
        sinks: dict[int, tuple[int, Any]] = {}
        rows, offs, steps, counts = [], [], [], []
        for _, off, n, _, sink in slices:
            step = max(n // self.sample, 1)
            rows.append(sinks.setdefault(id(sink), (len(sinks), sink))[0])
            offs.append(off)
            steps.append(step)
            counts.append(-(-n // step))  # the elements of a[off:off+n:step]
        c = torch.tensor(counts, device=dev)
        row_of = torch.repeat_interleave(torch.tensor(rows, device=dev), c)
        if max(steps) == 1:  # every slice binned whole: the chunk is the sample, in order
            hist = bin_rows(a, row_of, None, len(sinks), self.lo, self.bins)
        else:
            step_t = torch.repeat_interleave(torch.tensor(steps, device=dev), c)
            first = torch.repeat_interleave(torch.cumsum(c, 0) - c, c)
            idx = torch.repeat_interleave(torch.tensor(offs, device=dev), c)
            idx += (torch.arange(int(sum(counts)), device=dev) - first) * step_t
            sample = torch.index_select(a, 0, idx)  # index_select: a gather kernel, cheaper than a[idx]
            hist = bin_rows(sample, row_of, step_t.float(), len(sinks), self.lo, self.bins)
        for (_, sink), h in zip(sinks.values(), hist, strict=True):
            sink.add(h, None)

    def resolve(self) -> None:
        """Every handle made so far as a float (idempotent; later handles resolve on a later call)."""
        self.flush()
        if self._tensors:
            known, self._tensors = self._tensors, []
            for h, v in zip((h for h, _ in known), torch.stack([t.float() for _, t in known]).tolist(), strict=True):
                self.values[h] = v
        maxes, self._maxes = self._maxes, []
        values = self.values
        for h, parts in maxes:  # in order: each one's parts are resolved before it
            values[h] = nan_max([values[p] for p in parts])  # type: ignore[misc]

    def value(self, h: int) -> float:
        v = self.values[h]
        assert v is not None, "resolve() first"  # an internal order, not user input
        return v
