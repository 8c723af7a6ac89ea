"""An expert-parallel MoE layer as torchtitan / DeepSeek-V3 write it: a sigmoid router over all
experts, top-k, the routed tokens all-to-all'd to the EP rank owning their experts (dispatch),
this rank's experts, all-to-all back (combine), plus a shared expert. Each EP rank holds
``experts // ep`` experts (named by their global index), so each rank's module is its program.

The audits run on the fake process group (its all-to-all moves nothing, splits are equal);
the gloo tests run the same layer for real."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Expert(nn.Module):
    """A SwiGLU expert; it takes its input in its own dtype (as MoE code does before a grouped GEMM)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.gate_proj.weight.dtype)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class EPMoE(nn.Module):
    """One EP rank's MoE layer: ``experts // ep`` local experts, dispatch/combine on ``group``.
    ``back``: the dtype the experts' output is cast to before the combine (None: as computed)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        experts: int,
        top_k: int,
        ep: int,
        ep_rank: int,
        group: Any = None,
        back: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        local = experts // ep
        self.top_k, self.group, self.back = top_k, group, back
        self.verify, self.received_wrong = False, False
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleDict({str(ep_rank * local + i): Expert(hidden, inter) for i in range(local)})
        self.shared_experts = Expert(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        scores = self.gate(x).float().sigmoid()
        weights, _ids = scores.topk(self.top_k, dim=-1)
        routed = x.repeat_interleave(self.top_k, dim=0)
        received = torch.zeros_like(routed)  # zeros: the fake process group writes nothing into it
        dist.all_to_all_single(received, routed, group=self.group)
        chunks = received.chunk(len(self.experts))
        out = torch.cat([e(c) for e, c in zip(self.experts.values(), chunks, strict=True)])
        if self.back is not None:
            out = out.to(self.back)
        combined = torch.zeros_like(out)
        dist.all_to_all_single(combined, out, group=self.group)
        if self.verify:  # the real runs: did this rank receive the values the others sent?
            self.received_wrong = self.received_wrong or _wrong(out, combined, self.group)
        y = (combined.view(tokens, self.top_k, hidden) * weights.unsqueeze(-1).to(combined.dtype)).sum(1)
        return y.to(x.dtype) + self.shared_experts(x).to(x.dtype)


def _wrong(sent: torch.Tensor, received: torch.Tensor, group: Any) -> bool:
    """Whether ``received`` (an all-to-all's output) differs from what the group's ranks sent: each
    rank's ``sent`` all-gathered in f32 (a dtype every rank agrees on), chunk ``me`` of each."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    everyone = [torch.zeros(sent.shape, dtype=torch.float32) for _ in range(world)]
    dist.all_gather(everyone, sent.float(), group=group)
    expected = torch.cat([t.chunk(world)[me] for t in everyone])
    return not torch.equal(expected, received.float())


class MoEStack(nn.Module):
    """``layers`` EP MoE blocks with a pre-norm residual each (a decoder's MoE half)."""

    def __init__(self, layers: int, **kw: Any) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(kw["hidden"]) for _ in range(layers))
        self.moe = nn.ModuleList(EPMoE(**kw) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moe, strict=True):
            x = x + moe(norm(x))
        return x


# DeepSeek-V3 (config.json): hidden 7168, moe_intermediate_size 2048, 256 routed experts, 8 per token,
# one shared expert, 58 MoE layers (61 minus first_k_dense_replace=3)
DEEPSEEK_V3 = {"hidden": 7168, "inter": 2048, "experts": 256, "top_k": 8}
DEEPSEEK_V3_MOE_LAYERS = 58
