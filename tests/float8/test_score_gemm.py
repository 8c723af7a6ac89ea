"""A float8 GEMM scored by the error its result features get from both operands' casts."""

from __future__ import annotations

import pytest
import torch

from castwise.float8 import score as f8g
from castwise.float8.scaling import recipe_in, scale


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "mxfp8"])
def test_the_cast_is_torchs_own_rounding(dtype: str, scaling: str) -> None:
    # magnitudes over 2^-30..2^5: flushed, subnormal, normal and saturated values in every recipe
    torch.manual_seed(0)
    a = torch.randn(16, 96).abs() * torch.exp2(torch.randint(-30, 6, (16, 96)).float())
    fmax = torch.finfo(getattr(torch, dtype)).max
    scaled = (a * scale(a, recipe_in(scaling, dtype))).clamp(max=fmax)
    real = scaled.to(getattr(torch, dtype)).float()
    ratio, square = f8g._moments(a, scaling, dtype)
    assert torch.equal(ratio, real / scaled) and torch.equal(square, ratio.square())
    assert 0 < (ratio == 0).float().mean() < 1  # some flush, some do not


def test_a_term_is_lost_by_what_it_carried() -> None:
    # per tensor the weight's column 3 (10^-9) flushes whole: a lost line of the weight, but its
    # terms carried nothing of any output feature. Per row, the input's feature 3 at 10^-7 of its
    # row flushes by the row's own scale: nothing of the input alone, but against a weight column
    # 10^8 x the rest it was every output feature
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    w[:, 3] *= 1e-9
    x = torch.randn(32, 64)
    e4m3 = ("float8_e4m3fn", "float8_e4m3fn")
    tiny = f8g.shares(f8g.lost(x, w.t(), "tensorwise", e4m3))
    assert tiny["lost_cols"] == 0 and tiny["worst_cols"] < 0.08  # float8 rounding alone
    w[:, 3] *= 1e17
    x[:, 3] = 1e-7 * x.abs().amax(dim=1)
    met = f8g.shares(f8g.lost(x, w.t(), "rowwise", e4m3))
    assert met["lost_cols"] == 1 and met["worst_cols"] > 0.9
