"""float8 as it is trained: one GEMM operand scored under each scaling recipe.

A float8 GEMM scales each operand into the format before the cast: by its absmax per tensor
(tensorwise: torchao's default, TransformerEngine's delayed/current scaling), per row (rowwise),
or per block of 32 along the reduction dim with a power-of-two scale (MX, mxfp8). What matters
after scaling is the share of non-zero values below half the format's smallest subnormal (they
become zero) and the operand's dynamic range (log2 of its largest over its smallest non-zero
magnitude: a range wider than the format's cannot be held by one scale).
"""

from __future__ import annotations

import torch

RECIPES = ("tensorwise", "rowwise", "mxfp8")
MX_BLOCK = 32


def scores(t: torch.Tensor, top: float, bottom: float) -> dict[str, torch.Tensor]:
    """Per recipe, how many non-zero values of ``t`` flush after scaling (``top``: log2 of the
    format's largest, ``bottom``: log2 of half its smallest subnormal), the non-zero count and
    the dynamic range in powers of two; 0-d tensors (no host sync)."""
    a = t.detach().abs().float()
    a = a.reshape(-1, a.shape[-1]) if a.dim() >= 2 else a.reshape(1, -1)
    nonzero = a > 0
    line = 2.0 ** (bottom - top)  # scaled x = x * 2**top / amax flushes below 2**bottom
    out = {"nonzero": nonzero.sum()}
    out["tensorwise"] = (nonzero & (a < a.amax() * line)).sum()
    out["rowwise"] = (nonzero & (a < a.amax(dim=-1, keepdim=True) * line)).sum()
    n = a.shape[-1]
    padded = torch.nn.functional.pad(a, (0, (-n) % MX_BLOCK))
    blocks = padded.reshape(padded.shape[0], -1, MX_BLOCK)
    bmax = blocks.amax(dim=-1, keepdim=True).clamp(min=1e-38)
    scale = torch.exp2(torch.floor(top - torch.log2(bmax)))  # e8m0: a power of two
    out["mxfp8"] = ((blocks > 0) & (blocks * scale < 2.0**bottom)).sum()
    smallest = torch.where(nonzero, a, torch.inf).amin()
    out["range_pow2"] = torch.where(nonzero.any(), torch.log2(a.amax() / smallest), torch.zeros(()))
    return out


def shares(parts: dict[str, torch.Tensor]) -> dict[str, float]:
    """``scores`` as shares of the non-zero values (and the range), on the host."""
    n = float(parts["nonzero"])
    got = {r: (float(parts[r]) / n if n else 0.0) for r in RECIPES}
    got["range_pow2"] = float(parts["range_pow2"])
    return got
