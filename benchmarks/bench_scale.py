"""castwise at scale II: TP, pipeline and expert-parallel plans audited on a fake mesh (issue 37), measured.

    python benchmarks/bench_scale.py [--layers 126] [--seq 16] [--mode train] [--only pp,ep,faults]

Llama-3.1-405B (published config) built on the meta device, parallelized with DTensor's
``parallelize_module`` (column-parallel q/k/v/gate/up, row-parallel o/down: the usual plan) over
TP8 and sharded by FSDP2 (bf16 gather, f32 reduce) over dp=128: 1,024 ranks of torch's fake process
group. One audit of the rank program (local shards, the TP collectives); prints wall and CPU time,
peak RSS, the title and the collectives. Then the planted CW170 faults against their controls (a
Linear whose dims suit float8 unsharded and not on its TP shard; the same under MX), each a small
MLP on a fake TP mesh: found / clean.

``--only pp``: Llama-3.1-405B as TP8 x PP16 x DP8 (1,024 fake ranks): the published config built
once on the meta device, split as torchtitan's manual split does (stage k keeps its own layers
under their names; the first the embedding, the last the norm and head; 126 layers = 14 stages of
8 and 2 of 7, real shapes), each stage parallelized over tp=8, sharded by FSDP2 over dp=8 and
wrapped in a PipelineStage on the pp group; one audit per distinct stage program. ``--only ep``: a
DeepSeek-V3-shaped MoE (hidden 7168, 256 experts of 2048, top-8, a shared expert, 58 MoE layers)
over EP8 (32 experts per rank, all-to-all dispatch/combine), one audit per distinct expert-group
program. ``--only faults``: the planted pipeline / EP / collective faults and controls of
tests/distributed/_scale_cases.py audited, and (``--real``) each run for real with gloo.
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
sys.path.insert(0, str(Path(__file__).parent.parent))

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


def _timed_audit(obj: Any, inputs: Any, mode: str) -> tuple[castwise.Report, float, float]:
    """The audit for cuda, its wall and CPU seconds."""
    w0, c0 = time.perf_counter(), time.process_time()
    report = castwise.audit(obj, inputs, device="cuda", mode=mode)
    return report, time.perf_counter() - w0, time.process_time() - c0


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
        report, wall, cpu = _timed_audit(model, ids, mode)
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


class _LlamaStage(nn.Module):
    """One pipeline stage of a Llama built whole on meta (torchtitan's manual split): its decoder
    layers under their own indices, the embedding on the first, the norm and head on the last."""

    def __init__(self, model: Any, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layers})
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = inner.rotary_emb

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.rotary_emb(h, positions)
        for layer in self.layers.values():
            h = layer(h, position_embeddings=rope, position_ids=positions)
        if self.norm is not None and self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def _split(layers: int, stages: int) -> list[range]:
    """Layers per stage as torchtitan splits them: the remainder one layer short at the end."""
    per = -(-layers // stages)
    short = per * stages - layers
    sizes = [per] * (stages - short) + [per - 1] * short
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def audit_405b_pp(seq: int, mode: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaForCausalLM

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
    try:
        config = llama_405b(None)
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (8, 16, 8), mesh_dim_names=("dp", "pp", "tp"))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        stages = []
        splits = _split(config.num_hidden_layers, 16)
        for k, layers in enumerate(splits):
            stage = _LlamaStage(model, layers, k == 0, k == len(splits) - 1)
            plan = {k2.removeprefix("model."): v for k2, v in _plan(config.num_hidden_layers).items()}
            plan = {n: v for n, v in plan.items() if int(n.split(".")[1]) in layers}
            parallelize_module(stage, mesh["tp"], plan, src_data_rank=None)
            for layer in stage.layers.values():
                fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
            fully_shard(stage, mesh=mesh["dp"], mp_policy=mp)
            received = torch.zeros(1, seq, config.hidden_size, dtype=torch.bfloat16)
            declared = None if k == 0 else received
            stages.append(PipelineStage(stage, k, 16, torch.device("cpu"), declared, group=mesh.get_group("pp")))
        print(f"405B built, split into 16 stages, parallelized and sharded in {time.perf_counter() - t0:.1f} s")
        ids = torch.randint(0, config.vocab_size, (1, seq))
        report, wall, cpu = _timed_audit(stages, ids, mode)
    finally:
        dist.destroy_process_group()
    _print_programs(report, wall, cpu)


def _print_programs(report: castwise.Report, wall: float, cpu: float) -> None:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(report.title)
    print(
        f"audit: {wall:.1f} s wall, {cpu:.1f} s CPU; peak RSS {rss:.2f} GiB; "
        f"findings {[f.code for f in report.findings]}"
    )
    for p in report.extra["programs"]:
        dim = next(k for k in p if k in ("pp", "ep", "dp"))
        kinds: dict[tuple[str, str], int] = {}
        for c in p["collectives"]:
            kinds[(c["collective"], c["dtype"])] = kinds.get((c["collective"], c["dtype"]), 0) + c["calls"]
        shown = ", ".join(f"{k} {d}: {n}" for (k, d), n in sorted(kinds.items()))
        runs = ", ".join(f"{r['mode']} {r['status']}" for r in p["runs"])
        print(
            f"  {dim}={p[dim]} ({p['ranks']} ranks): {p['title']}; {runs}; {p['ops_traced']} ops; collectives {shown}"
        )
    for link in report.extra.get("p2p", [])[:3]:
        print(f"  send/recv stage {link['from']} -> {link['to']}: {link['send']} into {link['recv']}")


def audit_deepseek_ep(layers: int, mode: str) -> None:
    from tests.distributed._moe import DEEPSEEK_V3, MoEStack
    from torch.distributed.device_mesh import init_device_mesh

    from castwise.distributed.programs import RankPrograms

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("ep",))
        group = mesh.get_group("ep")
        t0 = time.perf_counter()
        with torch.device("meta"):
            ranks = tuple(
                MoEStack(layers, **DEEPSEEK_V3, ep=8, ep_rank=r, group=group).to(torch.bfloat16) for r in range(8)
            )
        print(f"DeepSeek-V3-shaped MoE ({layers} layers) built for 8 EP ranks in {time.perf_counter() - t0:.1f} s")
        tokens = torch.randn(16, DEEPSEEK_V3["hidden"], dtype=torch.bfloat16)
        report, wall, cpu = _timed_audit(RankPrograms(ranks, dim="ep", mesh=mesh), tokens, mode)
    finally:
        dist.destroy_process_group()
    _print_programs(report, wall, cpu)


def program_faults(real: bool) -> None:
    from tests.distributed._group import fake_process_group
    from tests.distributed._scale_cases import CASES, found, programs, real_outcome

    right = agree = ran = 0
    for i, case in enumerate(CASES):
        with fake_process_group(case.world), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = castwise.audit(programs(case), case.inputs(), mode="train")
        got = found(report)
        ok = got == set(case.expect)
        right += ok
        truth = real_outcome(i) if real and case.gloo else "-"
        if truth != "-":
            ran += 1
            agree += (truth != "ok") == case.planted
        kind = "fault" if case.planted else "control"
        print(f"  {kind:7} {case.name}: {sorted(got) or 'clean'} {'ok' if ok else 'WRONG'}; gloo: {truth}")
    faults = sum(c.planted for c in CASES)
    print(f"program cases: {right}/{len(CASES)} right ({faults} faults, {len(CASES) - faults} controls)", end="")
    print(f"; gloo agrees on {agree}/{ran}" if real else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=None, help="default: the config's 126")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--mode", default="train")
    parser.add_argument("--skip-cases", action="store_true")
    parser.add_argument("--only", default="", help="pp, ep, faults (comma-separated); default: the TP run")
    parser.add_argument("--moe-layers", type=int, default=58)
    parser.add_argument("--real", action="store_true", help="with --only faults: each case run for real on gloo")
    opts = parser.parse_args()
    only = set(filter(None, opts.only.split(",")))
    if "pp" in only:
        audit_405b_pp(opts.seq, opts.mode)
    if "ep" in only:
        audit_deepseek_ep(opts.moe_layers, opts.mode)
    if "faults" in only:
        program_faults(opts.real)
    if only:
        return
    audit_405b(opts.layers, opts.seq, opts.mode)
    if not opts.skip_cases:
        cw170_cases()


if __name__ == "__main__":
    main()
