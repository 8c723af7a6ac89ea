"""float8 as it is trained, scored on real tensors with ``scaling.scale``'s scales.

Per operand (``scores``): after scaling, the share of non-zero values that flush to zero, the
dynamic range, and the *lost lines*: rows and columns holding over half their energy in values
flushed or kept with two bits or fewer (a weight row is an output feature, a weight column an
input feature's gradient, an input or grad_output column along the tokens a weight gradient's).

Per GEMM (``lost``): ``A @ B`` with both operands scaled along the reduction dim and cast (bit for
bit torch's cast). A term errs by what the casts lost; with the terms' errors independent, a
result column is *lost* when its error is over ``threshold(scaling)`` of its terms' root-sum-square
(``ERROR``, 0.3, for float8; 0.5 for the 4-bit formats). This sees
what one operand cannot (a value flushed by its row's scale meeting a large one of the other
operand; an MX block flushed by one outlier); coherent errors are underestimated. Every sum is a
vector product along the reduction dim: a few passes over the operands, not the GEMM.

The 4-bit formats (``_lost4``) err by about 0.13 of a line's signal from rounding alone, so a
line's spread around that mean and the coherent error of a block's values flushed together
decide it: each line's error is measured instead, through a random sign sketch of the summed dim.
"""

from __future__ import annotations

import torch

from castwise.float8 import fp4
from castwise.float8.scaling import RECIPES, recipe_in, scale
from castwise.policy.float8 import FP4

# a result feature whose error is over this share of its terms' root-sum-square has lost most of
# its signal: one threshold per format, the one the leave-out filter (audit, forecast, apply) and
# the leave-out benchmarks all read. A feature flushed whole errs by about 1. float8 rounding errs
# by about 0.05 (bench_float8_leaveout's truth): 0.3. E2M1 rounding alone errs per feature by a
# median 0.13 (NVFP4) / 0.16-0.22 (MXFP4), 99th percentile up to 0.19 / 0.33, largest 0.25 / 0.43 on
# normal, Student-t(3) and log-normal operands (bench_nvfp4_leaveout.py --noise): 0.3 would call
# MXFP4's plain rounding lost, so the 4-bit formats count a feature lost past half its magnitude
ERROR = 0.3
ERRORS: dict[str, float] = {"nvfp4": 0.5, "mxfp4": 0.5}


def threshold(scaling: str) -> float:
    """The error (over a result feature's terms' root-sum-square) past which ``scaling``'s GEMM has
    lost that feature."""
    return ERRORS.get(scaling, ERROR)


# below 2^3 x the flush line a float8 value keeps at most two significant bits (e4m3's subnormals
# are m * 2^-9, e5m2's m * 2^-16): rounding there errs by 12% to 50%, as good as lost for a GEMM
DEGRADED = 3


def scores(t: torch.Tensor, dtype: str, bottom: float) -> dict[str, torch.Tensor]:
    """Per recipe, how many non-zero values of ``t`` flush once scaled into the float8 format
    ``dtype`` (``bottom``: log2 of half its smallest subnormal), the non-zero count and the
    dynamic range in powers of two; 0-d tensors (no host sync)."""
    a = t.detach().abs().float()
    a = a.reshape(-1, a.shape[-1]) if a.dim() >= 2 else a.reshape(1, -1)
    nonzero = a > 0
    out = {"nonzero": nonzero.sum(), "rows": torch.tensor(a.shape[0]), "cols": torch.tensor(a.shape[1])}
    for r in RECIPES:
        out[r] = (nonzero & _flushed(a, r, dtype, bottom)).sum()
        out[f"lost_rows_{r}"] = _lost_lines(a, r, dtype, bottom)
        out[f"lost_cols_{r}"] = _lost_lines(a.t(), r, dtype, bottom)
    smallest = torch.where(nonzero, a, torch.inf).amin()
    out["range_pow2"] = torch.where(nonzero.any(), torch.log2(a.amax() / smallest), torch.zeros(()))
    return out


def _flushed(a: torch.Tensor, scaling: str, dtype: str, bottom: float) -> torch.Tensor:
    """Which values of ``a`` fall under 2^bottom once ``scaling`` scales it along its rows."""
    flushed: torch.Tensor = a * scale(a, recipe_in(scaling, dtype)) < 2.0**bottom
    return flushed


def _lost_lines(a: torch.Tensor, scaling: str, dtype: str, bottom: float) -> torch.Tensor:
    """How many rows of ``a`` hold more than half their energy in values flushed or kept with at
    most two significant bits (under 2^DEGRADED x the flush line)."""
    energy = _squares(a, 1)
    gone = (energy * _flushed(a, scaling, dtype, bottom + DEGRADED)).sum(-1)
    lost: torch.Tensor = (gone > 0.5 * energy.sum(-1)).sum()
    return lost


def _moments(a: torch.Tensor, scaling: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value of ``a`` (magnitudes, scaled along its rows), q/a and (q/a)^2 where q is the
    value as the recipe casts it (scaled, clamped to the format's largest, rounded): 0 where it
    flushes, near 1 where it keeps its bits."""
    if scaling in FP4:  # the 4-bit formats' own blocks and E2M1 rounding (castwise.float8.fp4)
        cast = fp4.nvfp4(a) if scaling == "nvfp4" else fp4.mxfp4(a)
        ratio4 = torch.where(a > 0, cast / torch.where(a > 0, a, torch.ones_like(a)), torch.ones_like(a))
        return ratio4, ratio4.square()
    fi = torch.finfo(getattr(torch, dtype))
    s = (a * scale(a, recipe_in(scaling, dtype))).clamp(max=fi.max)  # torchao saturates before the cast
    # the cast, in float32 arithmetic (no float8 tensor: every device and tracer takes it): round
    # to nearest even on the value's binade's grid, the subnormals' grid below the smallest normal
    # 2^floor(log2 s) is s's float32 exponent bits alone
    binade = (s.view(torch.int32) & 0x7F800000).view(torch.float32)
    ulp = binade.clamp(min=fi.smallest_normal) * fi.eps
    cast = torch.round(s / ulp) * ulp
    ratio = torch.where(s > 0, cast / torch.where(s > 0, s, torch.ones_like(s)), torch.ones_like(s))
    return ratio, ratio.square()


def lost(
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: str,
    dtypes: tuple[str, str],
    error: float | None = None,
    rows: bool = True,
) -> dict[str, torch.Tensor]:
    """For the float8 GEMM ``a @ b`` (a: m x k, b: k x n; ``scaling`` one of tensorwise, rowwise,
    mxfp8, or the 4-bit nvfp4, mxfp4; ``dtypes`` the two operands' float8 formats, unused for
    4-bit): how many result columns and (with ``rows``) rows lose over ``error`` (None: the
    format's ``threshold``) of their signal, their counts and the worst error; 0-d tensors (no
    host sync)."""
    error = threshold(scaling) if error is None else error
    # a non-finite value is an overflow, reported as one; here it would make every ratio NaN
    if scaling in FP4:
        return _lost4(
            a.detach().float().nan_to_num(0.0, 0.0, 0.0),
            b.detach().float().nan_to_num(0.0, 0.0, 0.0),
            scaling,
            error,
            rows,
        )
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
    """``m`` over its largest (along ``dim``; None: all of it), squared: float32 holds it (1e-21
    squared would not)."""
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
    """``scores`` (an operand's) or ``lost`` (a GEMM's) on the host: shares of the non-zero
    values or of the result's lines, the range and the worst errors."""
    if "nonzero" not in parts:  # a GEMM's
        got: dict[str, float] = {}
        for line in ("cols", "rows"):
            if line in parts:
                got[f"lost_{line}"] = float(parts[f"lost_{line}"]) / max(int(parts[line]), 1)
                got[f"worst_{line}"] = float(parts[f"worst_{line}"])
        return got
    n = float(parts["nonzero"])
    got = {r: (float(parts[r]) / n if n else 0.0) for r in RECIPES}
    got["range_pow2"] = float(parts["range_pow2"])
    for r in RECIPES:
        for line in ("rows", "cols"):
            got[f"lost_{line}_{r}"] = float(parts[f"lost_{line}_{r}"]) / max(int(parts[line]), 1)
    return got


# result lines measured at once: a 4-bit GEMM's line error is no sum of independent terms (a
# block's small values flushed together err by their own sum, coherent over the tokens), so it
# is measured, through this many random sign sketches of the dim the line's error sums over
SKETCH = 32


def _lost4(a: torch.Tensor, b: torch.Tensor, scaling: str, error: float, rows: bool) -> dict[str, torch.Tensor]:
    """``lost`` for the 4-bit formats: each line's error measured on signed operands cast as the
    format casts them, ``S (A' B' - A B)`` for a random sign sketch ``S`` of the summed dim (the
    identity when that dim is SKETCH or shorter): SKETCH vector products, not the GEMM."""
    cast = fp4.nvfp4 if scaling == "nvfp4" else fp4.mxfp4
    qa, qb = cast(a), cast(b.t().contiguous()).t()
    got = _measured(qa, qb, a, b, error, "cols")
    if rows:
        got.update(_measured(qb.t(), qa.t(), b.t(), a.t(), error, "rows"))
    return got


def _measured(
    qa: torch.Tensor, qb: torch.Tensor, a: torch.Tensor, b: torch.Tensor, error: float, line: str
) -> dict[str, torch.Tensor]:
    """Per column of ``a @ b``: its error over its terms' root-sum-square, sketched over a's rows."""
    # each column over b's column largest and a over its own: float32 holds the squares
    sa = a.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    sb = b.abs().amax(dim=0, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    a, qa, b, qb = a / sa, qa / sa, b / sb, qb / sb
    m = a.shape[0]
    if m <= SKETCH:
        sketch = torch.eye(m, device=a.device)
    else:
        g = torch.Generator(device="cpu").manual_seed(0)
        sketch = (torch.randint(0, 2, (SKETCH, m), generator=g).float().mul(2).sub(1) / SKETCH**0.5).to(a.device)
    err = ((sketch @ qa) @ qb - (sketch @ a) @ b).square().sum(0)
    total = a.square().sum(0) @ b.square()
    live = total > 0
    # the sketch's estimate is the line's squared error times chi2(SKETCH)/SKETCH, unbiased: a
    # line counts when its estimate is over (summing each line's chance instead adds up the
    # sketch's noise over many lines near the threshold into false losses)
    return _counts(
        torch.where(live, err / torch.where(live, total, torch.ones_like(total)), torch.zeros_like(total)), error, line
    )
