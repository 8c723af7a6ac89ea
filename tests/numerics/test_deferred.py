"""Batched magnitudes (numerics/_deferred.py) give what reducing each tensor on its own gives."""

from __future__ import annotations

import math

import torch

from castwise.numerics._deferred import Magnitudes, nan_max
from castwise.numerics.ranges import _SENTINEL, HIST_BINS, HIST_LO, HIST_SAMPLE, absmax, log2_hist


class _Sink:
    def __init__(self) -> None:
        self.hist = torch.zeros(HIST_BINS)

    def add(self, hist: torch.Tensor, magnitudes: None = None) -> None:
        self.hist += hist


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    masked = torch.randn(4, 300)
    masked[:, :7] = torch.finfo(torch.float32).min  # a mask fill: left out of the absmax
    spiky = torch.randn(5000) * 1e-30  # subnormal-ish magnitudes, a strided sample (step 4)
    spiky[17] = math.inf
    spiky[18] = math.nan
    half = (torch.randn(3, 700) * 60000).half()  # values past float16's range saturate to Inf
    return [masked, spiky, half, torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(3000).bfloat16()]


def test_batched_maxima_and_histograms_match_each_tensor_reduced_on_its_own() -> None:
    mags = Magnitudes(HIST_SAMPLE, HIST_LO, HIST_BINS)
    tensors = _tensors()
    sinks = [_Sink(), _Sink()]
    handles = [mags.copy(t, _SENTINEL[t.dtype], sinks[i % 2]) for i, t in enumerate(tensors)]
    tensors[0].mul_(1e6)  # an in-place op after the copy changes nothing recorded
    tensors = _tensors()
    both = mags.max([handles[0], handles[2]])
    mags.resolve()
    want = [float(absmax(t)) for t in tensors]
    assert [mags.value(h) for h in handles] == want
    assert mags.value(both) == max(want[0], want[2])
    for i, sink in enumerate(sinks):
        expect = torch.zeros(HIST_BINS)
        for t in tensors[i::2]:
            a = t.reshape(-1).abs().float()
            step = max(a.numel() // HIST_SAMPLE, 1)
            expect += log2_hist(a[::step], step)
        assert torch.equal(sink.hist, expect)


def test_a_full_chunk_is_reduced_and_later_handles_resolve_on_a_later_call() -> None:
    from castwise.numerics import _deferred

    mags = Magnitudes(HIST_SAMPLE, HIST_LO, HIST_BINS)
    sink = _Sink()
    big = torch.full((_deferred.CHUNK - 10,), 2.0)
    first = mags.copy(big, _SENTINEL[torch.float32], sink)
    second = mags.copy(torch.full((100,), -3.0), _SENTINEL[torch.float32], sink)  # does not fit: a new chunk
    mags.resolve()
    assert (mags.value(first), mags.value(second)) == (2.0, 3.0)
    third = mags.known(torch.tensor(5.0))
    mags.resolve()
    assert mags.value(third) == 5.0 and math.isnan(nan_max([1.0, math.nan, 2.0]))
