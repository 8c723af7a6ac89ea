"""Tensor and sequence parallel plans (DTensor ``parallelize_module``) audited on a fake 2-D mesh:
the rank program on its local shards, the TP collectives with their dtypes, the whole mesh in the
title; FSDP2 on the data-parallel dim together with TP."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import castwise
from tests.distributed._group import fake_process_group
from tests.distributed._workers import batch, tiny_llama


def _llama_plan(layers: int = 2) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        plan |= {p + "self_attn.o_proj": RowwiseParallel(), p + "mlp.down_proj": RowwiseParallel()}
        plan |= {p + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
        plan |= {p + f"mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")}
    return plan


def _collectives(report: castwise.Report) -> set[tuple[str, str, str]]:
    return {(c["module"], c["collective"], c["dtype"]) for c in report.extra["collectives"]}


def test_tp_plan_is_audited_as_its_rank_program_on_a_cpu_mesh_for_cuda() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(tiny_llama(), mesh["tp"], _llama_plan())
        report = castwise.audit(model, batch(2), device="cuda", mode="train")
    # a "cpu" mesh audited for cuda: no FakeTensorDeviceMismatchError (CW130)
    assert report.ok and not report.findings, [f.message for f in report.findings]
    assert "TP2 over 8 ranks (dp=4, tp=2)" in report.title
    assert _collectives(report) == {
        (f"model.layers.{i}.{m}", "all-reduce", "f32") for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj")
    }


class _SPBlock(nn.Module):
    """A pre-norm MLP block under sequence parallel: the norm on seq/tp positions, the MLP on all."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.mlp = _MLP(128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _sp_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def test_fsdp2_with_sequence_parallel_gathers_local_shards_and_names_the_whole_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        model = nn.Sequential(_SPBlock(), _SPBlock())
        for block in model:
            parallelize_module(block, mesh["tp"], _sp_plan())
            fully_shard(block, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        report = castwise.audit(model, torch.randn(2, 8, 64), device="cuda", mode="train")
    assert report.ok, [f.message for f in report.findings]
    assert "FSDP2 x TP2 over 8 ranks (dp=4, tp=2)" in report.title
    # the MLP all-gathers the norm's seq/tp positions, the row-parallel layer reduce-scatters
    # its partial sums back onto them, both in the gathered bf16
    assert _collectives(report) == {
        (f"{i}.{m}", kind, "bf16")
        for i in range(2)
        for m, kind in (("mlp", "all-gather"), ("mlp.down", "reduce-scatter"))
    }


class _MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(64, hidden, bias=False)
        self.down = nn.Linear(hidden, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize(("hidden", "converted"), [(256, True), (200, False)])
def test_fp8_audit_of_a_tp_model_checks_the_local_gemm_dims(hidden: int, converted: bool) -> None:
    """fp8 on a TP model: no "mixed torch.Tensor and DTensor" CW130; the float8 leave-out sees the
    TP-local dims (256/8 = 32 runs in float8; 200/8 = 25 is left out)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with fake_process_group(16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(_MLP(hidden), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = castwise.audit(model, torch.randn(4, 64), device="cuda", policy="fp8", mode="eval")
    assert not [f for f in report.findings if f.code == "CW130"], [f.message for f in report.findings]
    left_out = " ".join(str(w.message) for w in caught)
    assert ("(64, 25) are not multiples of 16" in left_out) is not converted


class _Experts(nn.Module):
    """Expert parallel as MoE layers write it: the layer holds its process group and all-to-alls
    the tokens to the experts this rank owns."""

    def __init__(self, group: Any, garbage: float = 0.0) -> None:
        super().__init__()
        self.group, self.garbage = group, garbage
        self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        # the fake process group's all-to-all writes nothing: the buffer keeps what it held
        out = torch.full_like(x, self.garbage)
        dist.all_to_all_single(out, x, group=self.group)
        return sum((e(out) for e in self.experts), torch.zeros_like(out))


def test_a_model_holding_its_process_group_is_audited() -> None:
    """Not "cannot pickle 'ProcessGroup'": the copy shares the group, as the real run does."""
    import torch.distributed as dist

    with fake_process_group(4):
        model = _Experts(dist.new_group([0, 1, 2, 3]))
        report = castwise.audit(model, torch.randn(8, 32), policy="bf16-mixed", mode="train")
    assert report.ok, [f.message for f in report.findings]
    assert report.runs


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf")])
def test_a_buffer_holding_nan_or_inf_garbage_is_audited(garbage: float) -> None:
    """The all-to-all buffer keeps uninitialised memory (NaN, inf) under the fake process group:
    its values are no magnitude, and the audit says nothing of them (it raised "cannot convert
    float NaN to integer" where the positions observer sized a 16-bit grid from them)."""
    import torch.distributed as dist

    with fake_process_group(4):
        model = _Experts(dist.new_group([0, 1, 2, 3]), garbage)
        report = castwise.audit(model, torch.randn(8, 32), policy="bf16-mixed", mode="train")
    assert report.ok, [f.message for f in report.findings]
    assert not [f for f in report.findings if f.code in ("CW130", "CW141")], [f.message for f in report.findings]


@pytest.mark.parametrize(
    ("hidden", "tp", "policy", "expected"),
    [
        (208, 8, "fp8", {"up", "down"}),  # 208 = 13 x 16; 26 per rank
        (256, 8, "fp8", set()),  # 32 per rank: a multiple of 16
        (200, 8, "fp8", set()),  # not a multiple of 16 unsharded either: apply's filter leaves it out
        (208, 8, "bf16-mixed", set()),  # no float8 GEMM
        (384, 8, "mxfp8", {"up", "down"}),  # 48 per rank: a multiple of 16, not of MX's 32-element blocks
        (384, 8, "fp8", set()),
    ],
)
def test_cw170_names_the_linears_whose_tp_shard_breaks_the_lowp_gemm(
    hidden: int, tp: int, policy: str, expected: set[str]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with fake_process_group(tp):
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        model = parallelize_module(_MLP(hidden), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = castwise.audit(model, torch.randn(4, 64), device="cuda", policy=policy, mode="eval")
    assert {f.module for f in report.findings if f.code == "CW170"} == expected
