"""The NVFP4 GEMM forecast sees each result line's own error, not only its mean: a line whose
error sits in a few tokens crosses the threshold by chance, measured on emulated NVFP4."""

from __future__ import annotations

import torch

from castwise.float8 import fp4
from castwise.float8 import score as f8g

THRESHOLD = f8g.threshold("nvfp4")  # the one per-format threshold: the audit and bench_nvfp4_leaveout read it


def _weight(out: int = 512, k: int = 256) -> torch.Tensor:
    # each 16-block's first value (+-1) sets its scale, the others (under 0.15 of it) land on
    # E2M1's coarse bottom steps: every output feature errs by about a quarter, none by half
    g = torch.Generator().manual_seed(0)
    w = torch.rand(out, k, generator=g) * 0.15 * torch.randn(out, k, generator=g).sign()
    w[:, ::16] = torch.randn(out, k // 16, generator=g).sign()
    return w


def _tokens(n: int, outlier: float) -> torch.Tensor:
    x = torch.randn(n, 256, generator=torch.Generator().manual_seed(1))
    x[:, ::16] = 0  # the block-setting features are dead: the small weights carry every output
    x[0] *= outlier
    return x


def _truth(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of ``a @ b``'s columns whose emulated NVFP4 error is over THRESHOLD."""
    got = fp4.nvfp4(a.contiguous()).double() @ fp4.nvfp4(b.t().contiguous()).t().double()
    ref = a.double() @ b.double()
    norm = (a.double().square() @ b.double().square()).sqrt().norm(dim=0)
    return float(((got - ref).norm(dim=0) / norm > THRESHOLD).double().mean())


def _expected(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each column's error as independent terms would have it: the root of its terms' squared
    errors over their squares (the forecast's mean before it measured the spread)."""
    qa, qb = fp4.nvfp4(a.contiguous()).double(), fp4.nvfp4(b.t().contiguous()).t().double()
    a, b = a.double(), b.double()
    terms = a.unsqueeze(2) * b.unsqueeze(0)
    errs = qa.unsqueeze(2) * qb.unsqueeze(0) - terms
    return (errs.square().sum((0, 1)) / terms.square().sum((0, 1))).sqrt()


def _forecast(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    return f8g.shares(f8g.lost(a, b, "nvfp4", ("", ""), THRESHOLD, rows=False))


def test_an_outlier_tokens_columns_cross_the_threshold_by_chance() -> None:
    # one token 100x the others: each output column's error is one token's, a single signed sum,
    # as likely at twice its mean as at half. No column's mean error reaches the threshold, yet
    # about a tenth of them cross it; the forecast must see the tail
    x, w = _tokens(4, 100.0), _weight()
    truth, got = _truth(x, w.t()), _forecast(x, w.t())
    assert float(_expected(x, w.t()).max()) < THRESHOLD  # every column's expected error is under it
    assert truth > 0.05
    assert 0.5 * truth < got["lost_cols"] < 2 * truth


def test_many_like_tokens_average_the_chance_out() -> None:
    # the same weight against 64 like tokens: each column's error is a sum over 64 of them,
    # close to its mean, and none crosses; the forecast (sketched: 64 tokens) leaves it in too,
    # under bench_nvfp4_leaveout's 1% of columns
    x, w = _tokens(64, 1.0), _weight()
    truth, got = _truth(x, w.t()), _forecast(x, w.t())
    assert truth == 0.0
    assert got["lost_cols"] < 0.01


def test_plain_rounding_loses_nothing() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, 256, generator=g), torch.randn(512, 256, generator=g)
    x[0] *= 100
    assert _truth(x, w.t()) == 0.0
    assert _forecast(x, w.t())["lost_cols"] < 0.002


def test_each_format_has_one_threshold_above_its_own_rounding_noise() -> None:
    # heavy-tailed benign operands (Student-t(3)): MXFP4's plain E2M1 rounding errs by up to ~0.4
    # per feature, so float8's 0.3 calls some features lost that nothing flushed; the 4-bit
    # threshold (the default lost() reads, as the audit does) calls none
    g = torch.Generator().manual_seed(3)

    def t3(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / torch.randn(3, *shape, generator=g).square().mean(0).sqrt()

    x, w = t3(64, 256), t3(256, 256)
    assert (f8g.threshold("mxfp4"), f8g.threshold("nvfp4"), f8g.threshold("tensorwise")) == (0.5, 0.5, f8g.ERROR)
    as_float8 = f8g.shares(f8g.lost(x, w, "mxfp4", ("", ""), f8g.ERROR))
    own = f8g.shares(f8g.lost(x, w, "mxfp4", ("", "")))
    assert as_float8["lost_cols"] > 0.0 and own["lost_cols"] == 0.0
