"""FSDP2 for real: 2 CPU processes, gloo, a tiny Llama under ``castwise.fsdp2.fully_shard``.

One spawn runs every scenario (starting processes costs more than the steps). Checked: islands
run with f32 weights and linear layers with the compute dtype, gradients are reduce-scattered in
the policy's reduce dtype (f32 islands never below f32), and the loss of each step matches a
single-process run of the same training under ``castwise.apply`` of the same policy.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from tests.distributed import _workers

WORLD = 2
STEPS = 4
TRUE = "bf16-true"  # norms as f32 islands, everything else stored and gathered in bf16
MIXED = "bf16-mixed,keep[class:LlamaRMSNorm]=f32,reduce=bf16"  # f32 master weights, bf16 gather
SCENARIOS = [(TRUE, STEPS), (MIXED, STEPS)]
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp2") / "results.json"
    context = mp.start_processes(
        _workers.worker,
        args=(WORLD, _free_port(), str(out), SCENARIOS),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"the 2-process FSDP2 run took more than {TIMEOUT_S}s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    results: list[dict[str, Any]] = json.loads(Path(out).read_text())
    return {r["policy"]: r for r in results}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {policy: _workers.reference(policy, steps, WORLD) for policy, steps in SCENARIOS}


def test_islands_gather_and_run_in_f32_and_linears_in_the_compute_dtype(sharded: dict[str, Any]) -> None:
    for policy in (TRUE, MIXED):
        seen = sharded[policy]["seen"]
        assert seen["island_weight"] == ["f32"], policy
        assert seen["island_out"] == ["bf16"], policy  # cast back to the compute dtype
        assert seen["linear_weight"] == ["bf16"], policy
        assert seen["linear_out"] == ["bf16"], policy
        assert seen["logits"] == (["f32"] if policy == MIXED else ["bf16"]), policy


def test_sharded_parameters_are_stored_as_the_policy_says(sharded: dict[str, Any]) -> None:
    assert sharded[TRUE]["param_dtypes"] == ["bf16", "f32"]  # bf16 weights, f32 norm islands
    assert sharded[MIXED]["param_dtypes"] == ["f32"]  # f32 master weights everywhere


def test_gradients_reduce_in_the_declared_dtype(sharded: dict[str, Any]) -> None:
    assert sharded[TRUE]["reduce_dtypes"] == ["f32"]  # reduce=f32 (the default) for every unit
    # reduce=bf16 for the blocks and the root; the f32 islands reduce in f32
    assert sharded[MIXED]["reduce_dtypes"] == ["bf16", "f32"]
    units = {u["unit"]: u for u in sharded[MIXED]["plan"]}
    assert units["model.layers.0"]["reduce"] == "bf16"
    assert units["model.layers.0.input_layernorm"]["reduce"] == "f32"


def test_the_audit_of_the_really_sharded_model_reports_its_units(sharded: dict[str, Any]) -> None:
    for policy in (TRUE, MIXED):
        audit = sharded[policy]["audit"]
        assert audit["ok"] and "FSDP2 over 2 ranks" in audit["title"], policy
        units = {u["unit"]: u for u in audit["units"]}
        assert {k: units["model.layers.0"][k] for k in ("gather", "compute")} == {"gather": "bf16", "compute": "bf16"}
        assert units["model.norm"]["gather"] == "f32" and units["model.norm"]["kind"] == "island"
        assert units["model.layers.0"]["reduce"] == ("f32" if policy == TRUE else "bf16")


def test_loss_matches_a_single_process_run_under_the_same_policy(
    sharded: dict[str, Any], references: dict[str, Any]
) -> None:
    for policy, tolerance in ((TRUE, 2e-2), (MIXED, 5e-2)):
        got, want = sharded[policy]["losses"], references[policy]["losses"]
        assert len(got) == len(want) == STEPS
        assert want[-1] < want[0]  # it trains
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert abs(a - b) <= tolerance * abs(b), f"{policy} step {step}: sharded {a:.5f} vs single {b:.5f}"


def test_step_time_against_unsharded(sharded: dict[str, Any], references: dict[str, Any], capsys: Any) -> None:
    # reported, not asserted (a shared 2-core machine): the note in the issue quotes these
    with capsys.disabled():
        for policy in (TRUE, MIXED):
            a = statistics.median(sharded[policy]["times"][1:])
            b = statistics.median(references[policy]["times"][1:])
            gap = max(
                abs(x - y) / abs(y)
                for x, y in zip(sharded[policy]["losses"], references[policy]["losses"], strict=True)
            )
            print(
                f"\n[fsdp2 gloo 2 ranks] {policy}: step {a * 1e3:.1f} ms sharded vs {b * 1e3:.1f} ms unsharded; "
                f"loss within {gap:.1e} (relative) of the single-process run"
            )
    assert all(t > 0 for p in (TRUE, MIXED) for t in sharded[p]["times"])
