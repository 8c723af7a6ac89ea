"""float8 as it is trained: each GEMM of a Linear scored by the error its result features get.

A float8 GEMM ``A @ B`` scales both operands along its reduction dim (per tensor, per row of
``A`` and column of ``B``, or per MX block of 32 along it) and casts them. Each term
``A[i, k] * B[k, j]`` of a result column then errs by what the casts lost: all of it where
either value flushed to zero, its rounding where both are kept (the cast is computed, bit for bit
torch's own; a subnormal's rounding is a larger share of it). With the terms' errors independent,
a result column's squared error is the sum of its terms' squared errors, and the column is *lost*
when that error is over ``ERROR`` of the root-sum-square of its terms (the measure of a sum whose
terms cancel). Errors that add up coherently (one value repeated over the tokens, rounded alike
each time) are underestimated: that needs the GEMM itself.

Judged per GEMM, not per operand: a loss that needs both operands is seen (a row's small value,
flushed by its row's scale, meeting a large value of the other operand; an MX block flushed by one
outlier meeting the other operand's large values), and a flushed line whose terms carried
nothing is not. Every sum is a vector product along the reduction dim (the result's columns
need each operand reduced over its other dim first), so a GEMM costs a few passes over its
operands, not the GEMM.
"""

from __future__ import annotations

import math

import torch

# a result feature whose error is over this share of its terms' root-sum-square has lost most of
# its signal (bench_float8_leaveout's truth: a feature flushed whole errs by about 1, float8
# rounding by about 0.05)
ERROR = 0.3
MX_BLOCK = 32
# (largest, smallest normal exponent, mantissa bits) of each float8 format
FORMATS: dict[str, tuple[float, int, int]] = {
    "float8_e4m3fn": (448.0, -6, 3),
    "float8_e5m2": (57344.0, -14, 2),
}
# torchao's per-tensor and per-row scales are format max / max(amax, 1e-12)
AMAX_FLOOR = 1e-12


def _scaled(a: torch.Tensor, scaling: str, fmax: float) -> torch.Tensor:
    """``a``'s magnitudes (rows: scaled along their last dim) times the recipe's scale."""
    if scaling == "tensorwise":
        return a * (fmax / a.amax().clamp(min=AMAX_FLOOR))
    if scaling == "rowwise":
        # torchao's rowwise recipe floors its scales to a power of two
        scale = torch.exp2(torch.floor(torch.log2(fmax / a.amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR))))
        return a * scale
    n = a.shape[-1]
    padded = torch.nn.functional.pad(a, (0, (-n) % MX_BLOCK))
    blocks = padded.reshape(padded.shape[0], -1, MX_BLOCK)
    bmax = blocks.amax(dim=-1, keepdim=True).clamp(min=1e-38)
    # e8m0: the block's amax over the format's largest, rounded up to a power of two (RCEIL)
    scale = torch.exp2(torch.floor(math.log2(fmax) - torch.log2(bmax)))
    return (blocks * scale).reshape(padded.shape)[:, :n]


def _moments(a: torch.Tensor, scaling: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value of ``a`` (magnitudes, scaled along its rows), q/a and (q/a)^2 where q is the
    value as the recipe casts it (scaled, clamped to the format's largest, rounded): 0 where it
    flushes, near 1 where it keeps its bits."""
    fmax, emin, mant = FORMATS[dtype]
    s = _scaled(a, scaling, fmax).clamp(max=fmax)  # torchao saturates before the cast
    # the cast, in float32 arithmetic (no float8 tensor: every device and tracer takes it): round
    # to nearest even on the value's binade's grid, the subnormals' grid below the smallest normal
    # 2^floor(log2 s) is s's float32 exponent bits alone
    binade = (s.view(torch.int32) & 0x7F800000).view(torch.float32)
    ulp = binade.clamp(min=2.0**emin) * 2.0**-mant
    cast = torch.round(s / ulp) * ulp
    ratio = torch.where(s > 0, cast / torch.where(s > 0, s, torch.ones_like(s)), torch.ones_like(s))
    return ratio, ratio.square()


def lost(
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: str,
    dtypes: tuple[str, str],
    error: float = ERROR,
    rows: bool = True,
) -> dict[str, torch.Tensor]:
    """For the float8 GEMM ``a @ b`` (a: m x k, b: k x n; ``scaling`` one of tensorwise, rowwise,
    mxfp8; ``dtypes`` the two operands' float8 formats): how many result columns and (with
    ``rows``) rows lose over ``error`` of their signal, their counts and the worst error; 0-d
    tensors (no host sync)."""
    # a non-finite value is an overflow, reported as one; here it would make every ratio NaN
    a = a.detach().float().abs().nan_to_num(0.0, 0.0, 0.0)
    b = b.detach().float().abs().nan_to_num(0.0, 0.0, 0.0)
    ka, qa = _moments(a, scaling, dtypes[0])
    kb, qb = _moments(b.t(), scaling, dtypes[1])
    kb, qb = kb.t(), qb.t()
    # a term's squared error over its square is (q_a q_b)^2 - 2 q_a q_b + 1 (q: cast over value):
    # three sums of products, each a vector (one operand reduced over its other dim) times the
    # other's matrix. A column's ratio does not change when b's column or all of a is scaled, a
    # row's likewise: each over its largest before squaring, so float32 holds the squares
    a2 = _squares(a, None)
    b2 = _squares(b, 0)
    cols = _ratio(a2.sum(0), (a2 * ka).sum(0), (a2 * qa).sum(0), b2, b2 * kb, b2 * qb, left=True)
    got = _counts(cols, error, "cols")
    if rows:
        a2, b2 = _squares(a, 1), _squares(b, None)
        got.update(
            _counts(_ratio(b2.sum(1), (b2 * kb).sum(1), (b2 * qb).sum(1), a2, a2 * ka, a2 * qa, False), error, "rows")
        )
    return got


def _counts(ratios: torch.Tensor, error: float, line: str) -> dict[str, torch.Tensor]:
    """How many of the result's lines err by over ``error``, of how many, and the worst."""
    return {
        f"lost_{line}": (ratios > error**2).sum(),
        line: torch.tensor(ratios.numel()),
        f"worst_{line}": ratios.amax().sqrt() if ratios.numel() else torch.zeros(()),
    }


def _squares(m: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``m`` over its largest (along ``dim``; None: all of it), squared."""
    top = m.amax() if dim is None else m.amax(dim=dim, keepdim=True)
    return (m / top.clamp(min=torch.finfo(torch.float32).tiny)).square()


def _ratio(
    tot: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    m2: torch.Tensor,
    m2k: torch.Tensor,
    m2q: torch.Tensor,
    left: bool,
) -> torch.Tensor:
    """Per result feature, its squared error over its terms' sum of squares: one operand reduced
    (``tot``, ``first``, ``second``: a k-vector) against the other's matrices along k."""

    # float32 holds it: every term is a square over the operand's largest (at most 1), and a lost
    # feature's error is a tenth of its total or more
    def dot(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return v @ m if left else m @ v

    total = dot(tot, m2)
    err = (dot(second, m2q) - 2 * dot(first, m2k) + total).clamp(min=0)
    live = total > 0
    return torch.where(live, err / torch.where(live, total, torch.ones_like(total)), torch.zeros_like(total))


def shares(parts: dict[str, torch.Tensor]) -> dict[str, float]:
    """``lost`` as shares of the result's columns (and rows) and the worst errors, on the host."""
    got: dict[str, float] = {}
    for line in ("cols", "rows"):
        if line in parts:
            got[f"lost_{line}"] = float(parts[f"lost_{line}"]) / max(int(parts[line]), 1)
            got[f"worst_{line}"] = float(parts[f"worst_{line}"])
    return got
