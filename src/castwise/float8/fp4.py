"""4-bit GEMM operands as NVFP4 and MXFP4 make them, emulated in float32 on any device.

Both store E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) in blocks along the last
dim (a GEMM's reduction dim: callers put it there), rounded to nearest even after saturating at 6:

- NVFP4 (``nvfp4``): blocks of 16 (a weight's: 16x16 tiles, NVFP4 training's 2-d weight
  scales), each with an E4M3 scale, under an f32 scale per tensor
  (``amax / (448 * 6)``): torchao's two-level ``nvfp4_quantize`` and ``NVFP4Tensor.dequantize``,
  operation for operation (the block scale is ``block_amax / 6 / tensor_scale`` cast to e4m3, the
  values multiplied by ``(1 / tensor_scale) / block_scale``), so the result is bit for bit torchao's;
- MXFP4 (``mxfp4``): blocks of 32 with an E8M0 power-of-two scale, rounded up (RCEIL: the
  scale ``scaling.scale`` gives MXFP8, with E2M1's largest value), as torchao's
  ``MXFakeQuantizeConfig`` (its QAT default).

A trailing block shorter than the block size (a dim that is not a multiple) is scaled on its own,
as if padded with zeros; apply's filter leaves such Linears out anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from castwise.float8 import scaling
from castwise.policy.float8 import MX_BLOCK, NVFP4_BLOCK, Float8Recipe

__all__ = ["E2M1_MAX", "fake_quantize", "mxfp4", "nvfp4", "round_e2m1"]

E2M1_MAX = 6.0
_E4M3 = torch.finfo(torch.float8_e4m3fn)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, within +-6) rounded to nearest even on the E2M1 grid: steps of 0.5 below 2
    (the subnormal 0.5 included), 1 in [2, 4), 2 in [4, 6]."""
    a = x.abs()
    binade = (a.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2^floor(log2 a), exactly
    ulp = binade.clamp(min=1.0) * 0.5
    return torch.copysign(torch.round(a / ulp) * ulp, x)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[-1]
    padded = nn.functional.pad(x, (0, (-n) % block))
    return padded.reshape(*padded.shape[:-1], -1, block)


def _unblock(b: torch.Tensor, n: int) -> torch.Tensor:
    return b.flatten(-2)[..., :n]


def _tile_amax(x: torch.Tensor) -> torch.Tensor:
    """Per 1x16 block of 2-d ``x`` (zero-padded), the absmax of the 16x16 tile holding it."""
    rows = nn.functional.pad(x.abs(), (0, (-x.shape[-1]) % NVFP4_BLOCK, 0, (-x.shape[0]) % NVFP4_BLOCK))
    r, c = rows.shape
    tiles = rows.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, c // NVFP4_BLOCK, NVFP4_BLOCK).amax(dim=(1, 3))
    return tiles.repeat_interleave(NVFP4_BLOCK, dim=0)[: x.shape[0]]


def nvfp4(x: torch.Tensor, tensor_amax: torch.Tensor | None = None, tiles: bool = False) -> torch.Tensor:
    """``x`` as NVFP4 stores it, dequantized to float32 (``tensor_amax``: the per-tensor amax its
    f32 scale comes from, default ``x``'s own; ``tiles``: one block scale per 16x16 tile of a 2-d
    ``x``, as NVFP4 training quantizes weights, so that the transposed weight has the same values)."""
    x32 = x.detach().float()
    amax = x32.abs().amax() if tensor_amax is None else tensor_amax.float()
    tensor_scale = amax / (_E4M3.max * E2M1_MAX)
    safe = torch.where(tensor_scale > 0, tensor_scale, torch.ones_like(tensor_scale))  # an all-zero tensor
    b = _blocks(x32, NVFP4_BLOCK)
    block_amax = _tile_amax(x32) if tiles and x32.dim() == 2 else b.abs().amax(dim=-1)
    block_scale = (block_amax / E2M1_MAX / safe).clamp(min=_E4M3.tiny, max=_E4M3.max)
    block_scale = block_scale.to(torch.float8_e4m3fn).float()
    data = (b * ((1.0 / safe) / block_scale).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    out = round_e2m1(data) * (safe * block_scale).unsqueeze(-1)
    return _unblock(out, x.shape[-1])


def mxfp4(x: torch.Tensor) -> torch.Tensor:
    """``x`` as MXFP4 stores it (E8M0 RCEIL scales per 32), dequantized to float32."""
    x32 = x.detach().float()
    b = _blocks(x32, MX_BLOCK)
    s = scaling.mx_scale(b.abs().amax(dim=-1, keepdim=True), E2M1_MAX)
    return _unblock(round_e2m1((b * s).clamp(-E2M1_MAX, E2M1_MAX)) / s, x.shape[-1])


def fake_quantize(t: torch.Tensor, recipe: Float8Recipe, weight: bool = False) -> torch.Tensor:
    """``t`` through the recipe's 4-bit format and back, in ``t``'s dtype (an NVFP4 ``weight`` in
    16x16 tiles); gradient straight through."""
    q = (nvfp4(t, tiles=weight) if recipe.scaling == "nvfp4" else mxfp4(t)).to(t.dtype)
    return t + (q - t.detach()) if t.requires_grad else q
