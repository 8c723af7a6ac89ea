"""The modules the silent cases are built from: task wrappers around real library models (the loss,
the logprobs, the positions), and the hand-written kernels the threads describe (RoPE, ALiBi,
routers, norms, a chunked scan).

A module that narrows on purpose in its own code (``.to(self.low)``) reads the dtype from its
``low`` attribute, so the f32 reference run can set every ``low`` to f32 and run the same code
without the narrowing. ``upcast`` (a loss or logprob head) is the thread's fix: ``.float()``
before the op.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BF16 = torch.bfloat16


class LMLoss(nn.Module):
    """A causal-LM loss outside the library (torchtitan, Modalities, a custom trainer): the
    model's logits into ``loss_fn``; per-token NLL returned for the logprob metric."""

    def __init__(self, lm: nn.Module, upcast: bool = False, hf_loss: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.loss_fn = nn.CrossEntropyLoss(reduction="none")
        self.upcast = upcast
        self.hf_loss = hf_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.hf_loss:  # transformers' ForCausalLMLoss (it upcasts the logits itself)
            out = self.lm(input_ids=input_ids, labels=labels)
            return {"loss": out.loss}
        logits = self.lm(input_ids=input_ids).logits
        if self.upcast:
            logits = logits.float()
        nll = self.loss_fn(logits.flatten(0, 1), labels.flatten())
        return {"loss": nll.mean(), "nll": nll}


class LogProbs(nn.Module):
    """An RL trainer's per-token logprobs: logits / temperature, log_softmax, gather."""

    def __init__(self, temperature: float, upcast: bool = False) -> None:
        super().__init__()
        self.temperature = temperature
        self.upcast = upcast

    def forward(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            logits = logits.float()
        logp = torch.log_softmax(logits / self.temperature, dim=-1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class RLPolicy(nn.Module):
    def __init__(self, lm: nn.Module, temperature: float, upcast: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.logprobs = LogProbs(temperature, upcast)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logp = self.logprobs(self.lm(input_ids=input_ids).logits, labels)
        return {"loss": -logp.mean(), "nll": -logp}


class Positions(nn.Module):
    """position_ids from a padding mask's running count, as generation code derives them."""

    def forward(self, attention_mask: torch.Tensor) -> torch.Tensor:
        return (attention_mask.cumsum(-1) - 1).clamp(min=0).long()


class MaskedLM(nn.Module):
    """An LM called with a (float) attention mask whose cumsum gives the positions, plus an offset
    (a packed or continued long sequence)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.positions = Positions()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        pos = self.positions(attention_mask)
        logits = self.lm(input_ids=input_ids, position_ids=pos).logits
        return {"loss": logits.float().square().mean(), "out": logits}


class LMOut(nn.Module):
    """An LM at given (large) positions: the logits are the measured output."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.lm(input_ids=input_ids, position_ids=position_ids).logits
        return {"loss": logits.float().square().mean(), "out": logits}


class Classifier(nn.Module):
    """A timm classifier with a cross-entropy head outside the library's training script."""

    def __init__(self, net: nn.Module, upcast: bool = False) -> None:
        super().__init__()
        self.net = net
        self.loss_fn = nn.CrossEntropyLoss(reduction="none")
        self.upcast = upcast

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        if self.upcast:
            logits = logits.float()
        nll = self.loss_fn(logits, target)
        return {"loss": nll.mean(), "nll": nll}


class Denoiser(nn.Module):
    """A diffusers transformer called as a training step calls it; its prediction is measured."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, **kwargs: Any) -> dict[str, torch.Tensor]:
        out = self.net(**kwargs, return_dict=False)[0]
        return {"loss": out.float().square().mean(), "out": out}


# --- hand-written kernels -------------------------------------------------------------------


class NeoXRotary(nn.Module):
    """GPT-NeoX / Megatron's rotary table: positions made with ``type_as(self.inv_freq)``, so a
    buffer cast to bf16 rounds the positions themselves (256 and 257 are the same bf16)."""

    def __init__(self, dim: int, f32_phase: bool = False) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self.f32_phase = f32_phase
        self.dim = dim

    def forward(self, pos: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.f32_phase:  # the control: the table computed in f32 here, cast back with type_as
            inv = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, device=pos.device, dtype=torch.float32) / self.dim))
            freqs = torch.outer(pos.float(), inv)
        else:
            freqs = torch.outer(pos.type_as(self.inv_freq), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().type_as(like), emb.sin().type_as(like)


class CastRotary(nn.Module):
    """A rotary table whose inverse frequencies are cast to the compute dtype in its own code
    before the phase (sglang-jax #1472), positions and phase kept f32. ``phase_low``: the
    phase itself computed in that dtype (the bug twin)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (500000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self.low = BF16
        self.phase_low = False

    def forward(self, pos: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq.to(self.low)
        freqs = torch.outer(pos.to(inv.dtype) if self.phase_low else pos.float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().type_as(like), emb.sin().type_as(like)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class RopeAttention(nn.Module):
    def __init__(self, dim: int, heads: int, rotary: nn.Module) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rotary = rotary
        with torch.no_grad():  # peaked attention, as trained (at init the scores are ~0)
            self.qkv.weight[: 2 * dim].mul_(4.0)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        cos, sin = self.rotary(pos, q)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class RopeLM(nn.Module):
    """A one-block decoder with a hand-written rotary table, called at given positions."""

    def __init__(self, rotary: nn.Module, vocab: int = 512, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = RopeAttention(dim, heads, rotary)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        out = self.head(x + self.attn(x, position_ids[0]))
        return {"loss": out.float().square().mean(), "out": out}


class TimestepEmbedder(nn.Module):
    """A DiT's sinusoidal timestep embedding whose timestep is cast to the weights' dtype in its
    own code first (DiffSynth-Studio #1025: 998.39 becomes 1000)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.low = BF16

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.low)
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class TinyDiT(nn.Module):
    """Patchify, add the timestep embedding (adaLN shift), one MLP block, unpatchify."""

    def __init__(self, channels: int = 4, patch: int = 2, dim: int = 64) -> None:
        super().__init__()
        self.patch = nn.Conv2d(channels, dim, patch, stride=patch)
        self.t_embedder = TimestepEmbedder(dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.out = nn.Linear(dim, channels * patch * patch)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.patch(x.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2)
        h = h + self.t_embedder(t)[:, None]
        out = self.out(h + self.block(h))
        return {"loss": out.float().square().mean(), "out": out}
