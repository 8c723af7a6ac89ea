"""float8 as it is trained: one GEMM operand scored under each scaling recipe.

A float8 GEMM scales each operand into the format before the cast: by its absmax per tensor
(tensorwise: torchao's default, TransformerEngine's delayed/current scaling), per row (rowwise),
or per block of 32 along the reduction dim with a power-of-two scale (MX, mxfp8). What matters
after scaling is the share of non-zero values below half the format's smallest subnormal (they
become zero) and the operand's dynamic range (log2 of its largest over its smallest non-zero
magnitude: a range wider than the format's cannot be held by one scale).

A flushed value matters by what it carried: a value under 2^-19 of its row's largest is noise in
that row's dot product. So each operand is also scored by its *lost lines*: the share of its
rows, and of its columns, that hold more than half their energy (sum of squares) in values
flushed or kept with two bits or fewer, the recipe scaling along that line (per tensor; per line
for rowwise; per block of 32 along it for MX: each GEMM scales along its reduction dim). A lost
line is a lost feature of a GEMM result: a weight row (an output feature), a weight column (an
input feature's gradient), an input or grad_output column along the tokens (a column or row of
the weight gradient).
"""

from __future__ import annotations

import torch

RECIPES = ("tensorwise", "rowwise", "mxfp8")
MX_BLOCK = 32
# below 2^3 x the flush line a float8 value keeps at most two significant bits (e4m3's subnormals
# are m * 2^-9, e5m2's m * 2^-16): rounding there errs by 12% to 50%, as good as lost for a GEMM
DEGRADED = 3
# torchao's per-tensor and per-row scales are format max / max(amax, 1e-12)
# (torchao.float8.float8_utils.EPS): an operand whose amax is under it (a tiny grad_output) is
# scaled short of the format's range and its small values flush
AMAX_FLOOR = 1e-12


def scores(t: torch.Tensor, top: float, bottom: float) -> dict[str, torch.Tensor]:
    """Per recipe, how many non-zero values of ``t`` flush after scaling (``top``: log2 of the
    format's largest, ``bottom``: log2 of half its smallest subnormal), the non-zero count and
    the dynamic range in powers of two; 0-d tensors (no host sync)."""
    a = t.detach().abs().float()
    a = a.reshape(-1, a.shape[-1]) if a.dim() >= 2 else a.reshape(1, -1)
    nonzero = a > 0
    out = {"nonzero": nonzero.sum(), "rows": torch.tensor(a.shape[0]), "cols": torch.tensor(a.shape[1])}
    for r in RECIPES:
        out[r] = (nonzero & _flushed(a, r, top, bottom)).sum()
    for r in RECIPES:
        out[f"lost_rows_{r}"] = _lost(a, r, top, bottom)
        out[f"lost_cols_{r}"] = _lost(a.t(), r, top, bottom)
    smallest = torch.where(nonzero, a, torch.inf).amin()
    out["range_pow2"] = torch.where(nonzero.any(), torch.log2(a.amax() / smallest), torch.zeros(()))
    return out


def _flushed(a: torch.Tensor, recipe: str, top: float, bottom: float) -> torch.Tensor:
    """Which values of ``a`` flush when ``recipe`` scales it along its rows."""
    line = 2.0 ** (bottom - top)  # scaled x = x * 2**top / amax flushes below 2**bottom
    if recipe == "tensorwise":
        flushed: torch.Tensor = a < a.amax().clamp(min=AMAX_FLOOR) * line
        return flushed
    if recipe == "rowwise":
        flushed = a < a.amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) * line
        return flushed
    n = a.shape[-1]
    padded = torch.nn.functional.pad(a, (0, (-n) % MX_BLOCK))
    blocks = padded.reshape(padded.shape[0], -1, MX_BLOCK)
    bmax = blocks.amax(dim=-1, keepdim=True).clamp(min=1e-38)
    scale = torch.exp2(torch.floor(top - torch.log2(bmax)))  # e8m0: a power of two
    flushed = (blocks * scale < 2.0**bottom).reshape(padded.shape)[:, :n]
    return flushed


def _lost(a: torch.Tensor, recipe: str, top: float, bottom: float) -> torch.Tensor:
    """How many rows of ``a`` hold more than half their energy in values flushed or kept with at
    most two significant bits (under 2^DEGRADED x the flush line)."""
    # each row over its own largest before squaring: float32 holds it (1e-21 squared would not)
    energy = (a / a.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)).square()
    gone = (energy * _flushed(a, recipe, top, bottom + DEGRADED)).sum(-1)
    lost: torch.Tensor = (gone > 0.5 * energy.sum(-1)).sum()
    return lost


def shares(parts: dict[str, torch.Tensor]) -> dict[str, float]:
    """``scores`` as shares of the non-zero values (and the range), on the host."""
    n = float(parts["nonzero"])
    got = {r: (float(parts[r]) / n if n else 0.0) for r in RECIPES}
    got["range_pow2"] = float(parts["range_pow2"])
    rows, cols = int(parts["rows"]), int(parts["cols"])
    for r in RECIPES:
        got[f"lost_rows_{r}"] = float(parts[f"lost_rows_{r}"]) / max(rows, 1)
        got[f"lost_cols_{r}"] = float(parts[f"lost_cols_{r}"]) / max(cols, 1)
    return got
