"""castwise at scale II: a TP plan audited on a fake mesh (issue 37), measured.

    python benchmarks/bench_scale.py [--layers 126] [--seq 16] [--mode train]

Llama-3.1-405B (published config) built on the meta device, parallelized with DTensor's
``parallelize_module`` (column-parallel q/k/v/gate/up, row-parallel o/down: the usual plan) over
TP8 and sharded by FSDP2 (bf16 gather, f32 reduce) over dp=128: 1,024 ranks of torch's fake process
group. One audit of the rank program (local shards, the TP collectives); prints wall and CPU time,
peak RSS, the title and the collectives. Then the planted CW170 faults against their controls (a
Linear whose dims suit float8 unsharded and not on its TP shard; the same under MX), each a small
MLP on a fake TP mesh: found / clean. Pipeline stages are not built yet (PP16 of the issue's shape
is not part of this run).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).parent))

from bench_audit_7b import llama_405b

import castwise


def _plan(layers: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        plan |= {p + "self_attn.o_proj": RowwiseParallel(), p + "mlp.down_proj": RowwiseParallel()}
        plan |= {p + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
        plan |= {p + f"mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")}
    return plan


def audit_405b(layers: int | None, seq: int, mode: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaForCausalLM

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
    try:
        config = llama_405b(layers)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (128, 8), mesh_dim_names=("dp", "tp"))
        t0 = time.perf_counter()
        parallelize_module(model, mesh["tp"], _plan(config.num_hidden_layers), src_data_rank=None)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
        print(f"parallelized and sharded in {time.perf_counter() - t0:.1f} s")
        ids = torch.randint(0, config.vocab_size, (1, seq))
        w0, c0 = time.perf_counter(), time.process_time()
        report = castwise.audit(model, ids, device="cuda", mode=mode)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    finally:
        dist.destroy_process_group()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(report.title)
    print(
        f"audit: {wall:.1f} s wall, {cpu:.1f} s CPU; peak RSS {rss:.2f} GiB; "
        f"findings {[f.code for f in report.findings]}"
    )
    kinds: dict[tuple[str, str], int] = {}
    for c in report.extra["collectives"]:
        kinds[(c["collective"], c["dtype"])] = kinds.get((c["collective"], c["dtype"]), 0) + c["calls"]
    print("collectives:", ", ".join(f"{k} {d}: {n}" for (k, d), n in sorted(kinds.items())))


class _MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(64, hidden, bias=False)
        self.down = nn.Linear(hidden, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


# (hidden, tp, policy, planted): planted cases must be found at `up` and `down`, controls clean
CASES = (
    (208, 8, "fp8", True),
    (176, 2, "fp8", True),
    (400, 4, "fp8", True),  # 400 = 25 x 16; 100 per rank
    (384, 8, "mxfp8", True),
    (256, 8, "fp8", False),
    (208, 1, "fp8", False),
    (200, 8, "fp8", False),
    (208, 8, "bf16-mixed", False),
    (384, 8, "fp8", False),
    (512, 8, "mxfp8", False),
)


def cw170_cases() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    right = 0
    for hidden, tp, policy, planted in CASES:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        try:
            mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
            model = parallelize_module(_MLP(hidden), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = castwise.audit(model, torch.randn(4, 64), device="cuda", policy=policy, mode="eval")
        finally:
            dist.destroy_process_group()
        found = {f.module for f in report.findings if f.code == "CW170"}
        ok = found == ({"up", "down"} if planted else set())
        right += ok
        kind = "fault" if planted else "control"
        print(f"  hidden {hidden} tp{tp} {policy:<10} {kind}: CW170 at {sorted(found)} {'ok' if ok else 'WRONG'}")
    print(f"CW170 cases: {right}/{len(CASES)} right")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=None, help="default: the config's 126")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--mode", default="train")
    parser.add_argument("--skip-cases", action="store_true")
    opts = parser.parse_args()
    audit_405b(opts.layers, opts.seq, opts.mode)
    if not opts.skip_cases:
        cw170_cases()


if __name__ == "__main__":
    main()
