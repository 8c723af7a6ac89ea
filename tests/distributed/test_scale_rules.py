"""The scale-only rules CW171-CW173 on real torchao / FSDP2 / DTensor plans (fake process groups),
with their look-alike controls, and CW172's truth from a real 2-process gloo run."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import castwise
from tests.distributed import _tables
from tests.distributed._group import fake_process_group
from tests.distributed.test_audit_tp import _MLP

pytest.importorskip("torchao")


def _codes(report: castwise.Report, code: str) -> set[str]:
    return {f.module for f in report.findings if f.code == code}


@pytest.mark.parametrize(
    ("hidden", "world", "fp8_gather", "expected"),
    [
        (200, 16, True, {"up"}),  # 200 rows over 16 ranks; down's 64 rows divide
        (256, 16, True, set()),  # control: every sharded dim divides
        (200, 16, False, set()),  # control: float8 GEMMs, all-gather in high precision
        (200, 8, True, set()),  # control: 200 = 8 x 25
    ],
)
def test_cw171_names_the_weights_gathered_in_float8_over_an_uneven_shard(
    hidden: int, world: int, fp8_gather: bool, expected: set[str]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    with fake_process_group(world):
        model = _MLP(hidden)
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = castwise.audit(model, torch.randn(4, 64), mode="train")
    assert _codes(report, "CW171") == expected
    if expected:
        f = next(f for f in report.findings if f.code == "CW171")
        assert f.origin is not None and f.origin.tensor == "param up.weight"
        assert f"dim 0 ({hidden}) does not divide by {world}" in f.message


@pytest.mark.parametrize(
    ("cast", "positions", "expected"),
    [(True, "angles", {"layers.0", "layers.1"}), (False, "angles", set()), (True, "ids", set())],
)
def test_cw172_names_the_units_whose_input_cast_narrows_a_position_table(
    cast: bool, positions: str, expected: set[str]
) -> None:
    with fake_process_group(2):
        model = _tables.shard(_tables.Net(positions), cast)
        report = castwise.audit(model, torch.randn(2, 8, 32), mode="train")
    assert _codes(report, "CW172") == expected
    if expected:
        f = next(f for f in report.findings if f.code == "CW172")
        assert "`freqs` (f32 (8, 32))" in f.message and "to bf16" in f.message


class _Block(nn.Module):
    """An activation named like a table's neighbour but not one: `x` is narrowed on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * scale.to(x.dtype)


def test_cw172_leaves_activations_and_other_inputs_alone() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with fake_process_group(2):
        block = _Block()
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        report = castwise.audit(block, (torch.randn(2, 32), torch.ones(32)), mode="train")
    assert not _codes(report, "CW172")


def test_cw172_agrees_with_a_real_two_process_gloo_run(tmp_path: Path) -> None:
    """The real FSDP2 run hands the unit the f32 angles in bf16 exactly where CW172 says so."""
    out = tmp_path / "tables.json"
    context = mp.start_processes(
        _tables.worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail("the 2-process FSDP2 run took more than 120s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    results: list[dict[str, Any]] = json.loads(out.read_text())
    by_case = {(r["cast"], r["positions"]): r for r in results}
    assert by_case[(True, "angles")]["received"] == ["bfloat16"]
    assert by_case[(False, "angles")]["received"] == ["float32"]
    assert by_case[(True, "ids")]["received"] == ["int64"]
    for r in results:
        narrowed = r["received"] == ["bfloat16"]
        assert ("CW172" in r["codes"]) is narrowed, r


@pytest.mark.parametrize(("use_local_output", "expected"), [(False, {"up"}), (True, set())])
def test_cw173_names_a_float8_tp_style_that_keeps_its_output_a_dtensor(
    use_local_output: bool, expected: set[str]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    with fake_process_group(4):
        model = _MLP(256)
        convert_to_float8_training(model)
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        plan = {"up": Float8ColwiseParallel(use_local_output=use_local_output), "down": Float8RowwiseParallel()}
        parallelize_module(model, mesh, plan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = castwise.audit(model, torch.randn(16, 64), device="cuda", mode="eval")
    assert _codes(report, "CW173") == expected


def test_cw173_leaves_float8_under_plain_tp_styles_alone() -> None:
    """Plain Colwise/Rowwise: float8 GEMMs on DTensors, whose amax DTensor reduces over the group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import convert_to_float8_training

    with fake_process_group(4):
        model = _MLP(256)
        convert_to_float8_training(model)
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = castwise.audit(model, torch.randn(16, 64), device="cuda", mode="eval")
    assert not _codes(report, "CW173")
