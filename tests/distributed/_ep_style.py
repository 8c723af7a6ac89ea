"""Expert parallel the way torchtitan's ExpertParallel style makes it (written here, not copied):
a grouped-experts module whose weights ``[experts, in, out]`` are DTensors sharded on the expert
dim over an "ep" mesh dim (``distribute_module`` with a partition_fn), its forward on the local
experts, and the style's input/output functions doing the token dispatch and combine as
all-to-alls on the ep group. ``recv``: the dtype the dispatch allocates its receive buffer in
(None: the tokens' own, as ``torch.empty_like``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU experts as three stacked weights; the input is ``[experts, tokens, hidden]``."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, inter) * 0.1)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, inter) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, inter, hidden) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        return torch.bmm(nn.functional.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


class ExpertsOverEP(ParallelStyle):
    """Shards the experts' weights on dim 0 over the ep mesh; each rank sends every rank the tokens
    of that rank's experts (dispatch) and gets their outputs back (combine)."""

    def __init__(self, recv: torch.dtype | None = None) -> None:
        super().__init__()
        self.recv = recv

    def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))

    def _dispatch(self, module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[torch.Tensor]:
        (x,) = inputs  # [experts, tokens, hidden]: this rank's tokens for every expert
        ep = mesh.size()
        local = x.shape[0] // ep
        out = torch.empty(x.shape, dtype=self.recv or x.dtype)
        dist.all_to_all_single(out, x.contiguous(), group=mesh.get_group())
        # [ep (source rank), local experts, tokens, hidden] -> [local experts, ep * tokens, hidden]
        return (out.view(ep, local, *x.shape[1:]).transpose(0, 1).reshape(local, -1, x.shape[-1]),)

    def _combine(self, module: nn.Module, y: torch.Tensor, mesh: Any) -> torch.Tensor:
        ep = mesh.size()
        local, rows, hidden = y.shape
        sent = y.view(local, ep, rows // ep, hidden).transpose(0, 1).contiguous()
        back = torch.empty_like(sent)
        dist.all_to_all_single(back, sent, group=mesh.get_group())
        return back.view(ep * local, rows // ep, hidden)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._dispatch, self._combine)


class MoEBlock(nn.Module):
    """A router assigning each token's slot to an expert (here: equal capacity per expert), the
    grouped experts, and a shared expert beside them."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = GroupedExperts(experts, hidden, inter)
        self.shared = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        experts = self.gate.out_features
        weights = self.gate(x).softmax(-1)  # [tokens, experts]
        per = x.view(experts, tokens // experts, hidden)  # capacity tokens // experts per expert
        y = self.experts(per).reshape(tokens, hidden)
        return y * weights.amax(-1, keepdim=True) + self.shared(x)
