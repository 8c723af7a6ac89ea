"""Hand-written MoE routers and reductions of the silent cases (the threads' code, small)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tests.rules.fixtures.CW143_chunked_norm_in_bf16 import LoopNorm
from torch import nn


class Router(nn.Module):
    """A top-k softmax router (AstrAI #57). As written: softmax of the gate's logits in the
    activation dtype, top-k on those probabilities (near ties collapse in bf16). ``upcast``: the
    thread's fix (probabilities in f32 through top-k); ``type_as``: the f32 softmax cast back to
    the activation dtype before top-k; ``f32``: the gate itself in f32 (the control)."""

    def __init__(self, dim: int, experts: int, k: int, type_as: bool = False, f32: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        nn.init.normal_(self.gate.weight, std=0.01)  # a router at init: small logits
        self.k = k
        self.type_as = type_as
        self.f32 = f32
        self.upcast = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.f32:
            probs = F.linear(x.float(), self.gate.weight.float()).softmax(-1)
        elif self.type_as:
            probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
            probs = probs if self.upcast else probs.type_as(x)
        else:
            logits = self.gate(x)
            probs = (logits.float() if self.upcast else logits).softmax(-1)
        weights, idx = probs.topk(self.k, dim=-1)
        return weights, idx


class BiasRouter(nn.Module):
    """DeepSeek-V3's aux-loss-free router: sigmoid scores in f32, plus a per-expert correction
    bias buffer (updated by the trainer) for the choice only. A buffer cast rounds the bias."""

    def __init__(self, dim: int, experts: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim) * 0.01)
        # a bias as training leaves it: ~0.3 with per-expert differences of a few 1e-3
        self.register_buffer("e_score_correction_bias", 0.3 + 0.02 * torch.randn(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        _, idx = (scores + self.e_score_correction_bias).topk(self.k, dim=-1)
        weights = scores.gather(-1, idx)
        return weights / weights.sum(-1, keepdim=True), idx


class MoE(nn.Module):
    """Experts as two stacked weights, every expert computed densely (small), the chosen gathered."""

    def __init__(self, dim: int, router: nn.Module, experts: int, hidden: int = 32) -> None:
        super().__init__()
        self.router = router
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, idx = self.router(x)
        h = torch.einsum("nd,edh->neh", x, self.w1).relu()
        y = torch.einsum("neh,ehd->ned", h, self.w2)
        chosen = y.gather(1, idx[..., None].expand(-1, -1, y.shape[-1]))
        return (chosen * weights[..., None].to(chosen.dtype)).sum(1), idx


class MoETask(nn.Module):
    """A trunk (token embedding, a ViT's or a DiT's patch embedding) into one MoE layer."""

    def __init__(self, trunk: nn.Module, moe: MoE) -> None:
        super().__init__()
        self.trunk = trunk
        self.moe = moe

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        h = h.flatten(0, -2)
        out, idx = self.moe(h)
        return {"loss": out.float().square().mean(), "out": out, "experts": idx}


class ChunkRMSNorm(LoopNorm):
    """RMSNorm whose sum of squares a hand-written loop accumulates chunk by chunk in the input
    dtype (meta-llama/llama #1048's norm in 16-bit, as a kernel port writes it): the CW143
    fixture's loop (``acc_f32``: the accumulator float32; ``kahan``: a compensated loop)."""

    def __init__(self, dim: int, chunk: int = 4, eps: float = 1e-6, acc_f32: bool = False, kahan: bool = False) -> None:
        super().__init__(dim, chunk, acc_f32, kahan)
        self.eps = eps
        self.upcast = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if self.upcast else x
        acc = self.sum_of_squares(h)
        return (h * torch.rsqrt(acc.to(h.dtype) / h.shape[-1] + self.eps)).type_as(x) * self.weight


class NormLM(nn.Module):
    """Embedding (wide), one norm, a head: the norm's reduction is over 1024 channels."""

    def __init__(self, norm: nn.Module, vocab: int = 512, dim: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = norm
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.head(self.norm(self.embed(input_ids)))
        return {"loss": out.float().square().mean(), "out": out}


class ChunkScan(nn.Module):
    """Chunked linear attention (a hand-written scan, as Mamba-2 / linear-attention ports write
    it): the running state ``k^T v`` accumulated chunk after chunk in the activation dtype."""

    def __init__(self, dim: int, chunk: int = 4) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.chunk = chunk
        self.upcast = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.elu(self.qkv(x)).add(1).chunk(3, dim=-1)
        state = torch.zeros(
            x.shape[0], x.shape[-1], x.shape[-1], dtype=torch.float32 if self.upcast else x.dtype, device=x.device
        )
        outs = []
        for qc, kc, vc in zip(q.split(self.chunk, 1), k.split(self.chunk, 1), v.split(self.chunk, 1), strict=True):
            state = state + (kc.transpose(1, 2) @ vc).to(state.dtype)
            outs.append((qc.to(state.dtype) @ state).to(x.dtype))
        return torch.cat(outs, dim=1)


class ScanLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mixer = ChunkScan(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        mixed = self.mixer(self.embed(input_ids)) / input_ids.shape[1]
        return {"loss": self.head(mixed).float().square().mean(), "out": mixed}


class LoadBalance(nn.Module):
    """Switch-style auxiliary loss E * sum_i f_i * P_i, the per-expert token counts f_i taken with
    ``index_add_`` of ones in the activation dtype (bf16 counts stop at 256)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.upcast = False

    def forward(self, probs: torch.Tensor, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(idx.numel(), dtype=torch.float32 if self.upcast else like.dtype, device=like.device)
        counts = torch.zeros(self.experts, dtype=ones.dtype, device=like.device).index_add_(0, idx.flatten(), ones)
        share = counts.float() / idx.numel()
        return self.experts * (share * probs.mean(0)).sum()


class AuxTask(nn.Module):
    """Token embedding, a router (f32 softmax, top-2) and its load-balancing loss."""

    def __init__(self, tokens: int = 4096, dim: int = 64, experts: int = 8) -> None:
        super().__init__()
        self.trunk = nn.Embedding(tokens, dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.balance = LoadBalance(experts)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        probs = self.gate(h).float().softmax(-1)
        idx = probs.topk(2, dim=-1).indices
        aux = self.balance(probs, idx, h)
        return {"loss": aux, "out": aux.reshape(1)}
