"""Flux-family attention (QK-RMSNorm) into external kernels, audited on simulated CUDA.

Since torch 2.12, CUDA autocast runs rms_norm in float32: a Flux / Flux2 / LTX2-style block that
normalises q and k hands f32 q/k and a bf16 v to its attention kernel, which flash-attn,
SageAttention and xFormers refuse on the GPU (diffusers#14104). The packages are not installed
here: each kernel is registered as a torch.library custom op under the package's own op name
(as a model wrapping the kernel does), with a composite body and fake kernel that accept anything,
so only castwise's contract (or CW160 for an op without one) can find the mix.

For every model, a training and an inference audit (``mode="both"``) with ``device="cuda"`` on
the CPU-only build:
- found: the error (CW104, from the kernel's contract) or the CW160 warning (no contract), in both
  modes;
- origin: the finding's origin is the q/k norm;
- clean: the same model with the cast back after the norm (``q.to(v.dtype)``) has no error and no
  CW160.

    python benchmarks/bench_external_kernels.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import castwise

# the op names the packages register (flash-attn 2 and 3, xFormers, SageAttention), and ops no
# package registers (CW160's case: castwise has no contract for them)
KERNELS = (
    "flash_attn::_flash_attn_forward",
    "flash_attn::_flash_attn_varlen_forward",
    "flash_attn_3::fwd",
    "xformers::efficient_attention_forward_cutlass",
    "xformers_flash::flash_fwd",
    "sageattention::sageattn",
    "bench_models::fused_attention",
)


def _register(qualname: str) -> None:
    ns, name = qualname.split("::")
    if hasattr(getattr(torch.ops, ns), name):
        return

    @torch.library.custom_op(qualname, mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (B, S, H, D) like flash-attn; GQA: k/v heads repeat
        rep = q.shape[2] // k.shape[2]
        qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
        kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2).to(v.dtype)

    @op.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.new_empty(q.shape, dtype=v.dtype)

    def setup(ctx: object, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        ctx.shapes = [(t.shape, t.dtype) for t in inputs]  # type: ignore[attr-defined]

    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shapes = ctx.shapes  # type: ignore[attr-defined]
        return tuple(grad.new_zeros(s, dtype=d) for s, d in shapes)

    op.register_autograd(backward, setup_context=setup)


for _k in KERNELS:
    _register(_k)


def _call(qualname: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    ns, name = qualname.split("::")
    out: torch.Tensor = getattr(getattr(torch.ops, ns), name)(q, k, v)
    return out


class QKNorm(nn.Module):
    """Flux's QKNorm: an RMSNorm for q and one for k (``functional``: F.rms_norm in forward)."""

    def __init__(self, dim: int, functional: bool = False) -> None:
        super().__init__()
        self.functional = functional
        self.query_norm = nn.RMSNorm(dim, eps=1e-6)
        self.key_norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.functional:
            return (
                F.rms_norm(q, q.shape[-1:], self.query_norm.weight, 1e-6),
                F.rms_norm(k, k.shape[-1:], self.key_norm.weight, 1e-6),
            )
        return self.query_norm(q), self.key_norm(k)


class Attention(nn.Module):
    """Self- or joint attention with QK norm; ``cast_back``: the fix after the norm."""

    def __init__(self, kernel: str, dim: int, heads: int, kv_heads: int, cast_back: bool, functional: bool) -> None:
        super().__init__()
        self.kernel, self.heads, self.kv_heads, self.cast_back = kernel, heads, kv_heads, cast_back
        self.head_dim = dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.norm = QKNorm(self.head_dim, functional)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        src = x if context is None else context
        q = self.to_q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.to_kv(src).view(b, src.shape[1], 2 * self.kv_heads, self.head_dim).chunk(2, dim=2)
        q, k = self.norm(q, k)
        if self.cast_back:
            q, k = q.to(v.dtype), k.to(v.dtype)
        return self.to_out(_call(self.kernel, q, k, v).reshape(b, s, -1))


class DoubleStreamBlock(nn.Module):
    """Flux's double-stream block: image and text streams, each with its QK norm, joint attention."""

    def __init__(self, kernel: str, dim: int, heads: int, cast_back: bool) -> None:
        super().__init__()
        self.kernel, self.heads, self.cast_back = kernel, heads, cast_back
        self.img_qkv, self.txt_qkv = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.img_norm, self.txt_norm = QKNorm(dim // heads), QKNorm(dim // heads)
        self.img_mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.proj = nn.Linear(dim, dim)

    def _qkv(self, lin: nn.Linear, norm: QKNorm, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = x.shape
        q, k, v = lin(x).view(b, s, 3, self.heads, -1).unbind(2)
        q, k = norm(q, k)
        if self.cast_back:
            q, k = q.to(v.dtype), k.to(v.dtype)
        return q, k, v

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        iq, ik, iv = self._qkv(self.img_qkv, self.img_norm, img)
        tq, tk, tv = self._qkv(self.txt_qkv, self.txt_norm, txt)
        q, k, v = (torch.cat(p, dim=1) for p in ((tq, iq), (tk, ik), (tv, iv)))
        out = _call(self.kernel, q, k, v).flatten(2)[:, txt.shape[1] :]
        img = img + self.proj(out)
        return img + self.img_mlp(img)


class SingleStreamBlock(nn.Module):
    """Flux's single-stream block: one linear makes q/k/v and the MLP input, run in parallel."""

    def __init__(self, kernel: str, dim: int, heads: int, cast_back: bool) -> None:
        super().__init__()
        self.kernel, self.heads, self.dim, self.cast_back = kernel, heads, dim, cast_back
        self.pre_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.linear1 = nn.Linear(dim, 3 * dim + 4 * dim)
        self.norm = QKNorm(dim // heads)
        self.linear2 = nn.Linear(dim + 4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv, mlp = self.linear1(self.pre_norm(x)).split([3 * self.dim, 4 * self.dim], dim=-1)
        q, k, v = qkv.view(b, s, 3, self.heads, -1).unbind(2)
        q, k = self.norm(q, k)
        if self.cast_back:
            q, k = q.to(v.dtype), k.to(v.dtype)
        attn = _call(self.kernel, q, k, v).flatten(2)
        return x + self.linear2(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))


class Wrap(nn.Module):
    def __init__(self, block: nn.Module, cross: bool = False) -> None:
        super().__init__()
        self.block, self.cross = block, cross

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        if isinstance(self.block, DoubleStreamBlock):
            out: torch.Tensor = self.block(x, ctx)
        elif isinstance(self.block, Attention):
            out = self.block(x, ctx if self.cross else None)
        else:
            out = self.block(x)
        return out


@dataclass(frozen=True)
class Model:
    name: str
    kernel: str
    build: Callable[[str, bool], nn.Module]  # (kernel, cast_back) -> the model


DIM, HEADS = 128, 2  # head dim 64: inside every kernel's head-size limits


def _attn(kv_heads: int = HEADS, cross: bool = False, functional: bool = False) -> Callable[[str, bool], nn.Module]:
    return lambda kernel, cast_back: Wrap(Attention(kernel, DIM, HEADS, kv_heads, cast_back, functional), cross)


MODELS = (
    Model(
        "flux-double-stream", "flash_attn::_flash_attn_forward", lambda k, c: Wrap(DoubleStreamBlock(k, DIM, HEADS, c))
    ),
    Model("flux-single-stream", "flash_attn_3::fwd", lambda k, c: Wrap(SingleStreamBlock(k, DIM, HEADS, c))),
    Model("flux2-self-attention", "sageattention::sageattn", _attn()),
    Model("ltx2-cross-attention", "xformers::efficient_attention_forward_cutlass", _attn(cross=True)),
    Model("ltx2-gqa-attention", "xformers_flash::flash_fwd", _attn(kv_heads=1)),
    Model("flux-varlen-attention", "flash_attn::_flash_attn_varlen_forward", _attn(functional=True)),
    Model(
        "flux2-single-stream-sage", "sageattention::sageattn", lambda k, c: Wrap(SingleStreamBlock(k, DIM, HEADS, c))
    ),
    Model(
        "custom-op-double-stream",
        "bench_models::fused_attention",
        lambda k, c: Wrap(DoubleStreamBlock(k, DIM, HEADS, c)),
    ),
    Model("custom-op-cross-attention", "bench_models::fused_attention", _attn(cross=True, functional=True)),
)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 16, DIM, generator=g), torch.randn(2, 8, DIM, generator=g)


def _audit(model: Model, cast_back: bool) -> castwise.Report:
    return castwise.audit(
        model.build(model.kernel, cast_back), _inputs(), policy="bf16-mixed", device="cuda", mode="both"
    )


def _is_norm(module: str | None) -> bool:
    return bool(module) and module.rsplit(".", 1)[-1] in ("norm", "img_norm", "txt_norm", "query_norm", "key_norm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model names (default: all)")
    args = parser.parse_args()
    chosen = [m for m in MODELS if not args.models or m.name in args.models.split(",")]
    found = origin = clean = 0
    started = time.perf_counter()
    print(f"{'model':28} {'kernel':46} {'finding':8} {'modes':12} {'origin':28} clean")
    for m in chosen:
        report = _audit(m, cast_back=False)
        hits = [f for f in report.findings if f.code in ("CW104", "CW160")]
        hit = hits[0] if hits else None
        modes = set(hit.modes) if hit else set()
        at_norm = hit is not None and hit.origin is not None and _is_norm(hit.origin.module)
        fixed = _audit(m, cast_back=True)
        is_clean = not fixed.errors and not any(f.code == "CW160" for f in fixed.findings)
        found += modes == {"train", "eval"}
        origin += at_norm
        clean += is_clean
        where = hit.origin.module if hit and hit.origin else "-"
        code = hit.code if hit else "-"
        print(f"{m.name:28} {m.kernel:46} {code:8} {','.join(sorted(modes)) or '-':12} {where or '-':28} {is_clean}")
    n = len(chosen)
    took = time.perf_counter() - started
    print(
        f"\nfound (train and eval): {found}/{n}  origin at the norm: {origin}/{n}  "
        f"clean with the cast back: {clean}/{n}"
    )
    print(f"({2 * n} audits, {took:.0f} s)")


if __name__ == "__main__":
    main()
