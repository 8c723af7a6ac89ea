"""A model passing a position table to its FSDP2 units, and the 2-rank gloo worker that shards it
for real and records the dtype each unit receives (CW172's truth; imported by spawn)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

# (cast_forward_inputs, positions as "angles" (an f32 table) or "ids" (integer positions))
CASES = [(True, "angles"), (False, "angles"), (True, "ids")]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.inv_freq = 1.0 / 10000 ** (torch.arange(32) / 32)
        self.received: set[str] = set()

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        self.received.add(str(freqs.dtype).removeprefix("torch."))
        if not freqs.is_floating_point():  # integer positions: the angles are made here, in f32
            freqs = torch.outer(freqs.float(), self.inv_freq.to(freqs.device))
        x = x.to(self.proj.weight.dtype)  # the activations in the gathered dtype, cast or not
        return self.proj(x) * torch.cos(freqs).to(x.dtype)


class Net(nn.Module):
    def __init__(self, positions: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(32) / 32), persistent=False)
        self.positions = positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        freqs = torch.outer(pos.float(), self.inv_freq) if self.positions == "angles" else pos
        for layer in self.layers:
            x = layer(x, freqs)
        return x


def shard(model: Net, cast: bool) -> Net:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=cast)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def worker(rank: int, world: int, store: str, out_path: str) -> None:
    import torch.distributed as dist

    import castwise

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # a file store: no TCP port to pick, which another process could take between the pick and the bind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        # every collective first, in step on both ranks; then rank 0 audits while rank 1 waits at a
        # barrier, so neither rank leaves the group (or the process) while the other still uses it
        runs: list[tuple[bool, str, Net, list[str]]] = []
        for cast, positions in CASES:
            torch.manual_seed(0)
            model = shard(Net(positions), cast)
            model(torch.randn(2, 8, 32)).float().sum().backward()
            received = sorted({d for layer in model.layers for d in layer.received})  # type: ignore[union-attr]
            runs.append((cast, positions, model, received))
        dist.barrier()
        if rank == 0:  # the audit reads the sharded model on its own (no collective): one rank is enough
            results: list[dict[str, Any]] = []
            for cast, positions, model, received in runs:
                report = castwise.audit(model, torch.randn(2, 8, 32), mode="train")
                codes = sorted({f.code for f in report.findings})
                results.append({"cast": cast, "positions": positions, "received": received, "codes": codes})
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
