"""CW232 at runtime: castwise run's probe reads the reduce dtype FSDP2 really uses (one gloo rank
here; benchmarks/bench_ledger_runtime.py runs 2 ranks and measures the reduced gradient)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from castwise.ledger.fsdp import reduce_dtypes
from castwise.ledger.runtime import StepProbe, watch_steps


@pytest.fixture
def one_rank(tmp_path: Path):  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _codes(reduce: torch.dtype, param: torch.dtype | None = None) -> tuple[list[str], str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce))
    names = {id(p): n for n, p in model.named_parameters()}
    probe = StepProbe(names=lambda p: names.get(id(p)), modules=lambda: [model])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch_steps(probe):
        for _ in range(2):
            model(torch.randn(4, 16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert set(reduce_dtypes([model])) == {id(p) for p in model.parameters()}
    (ledger,) = probe.ledgers
    return [f.code for f in ledger.findings], ledger.rows[0].reduction.value


@pytest.mark.usefixtures("one_rank")
def test_fsdp2_reduce_narrower_than_the_gradient_is_cw232_and_controls_stay_clean() -> None:
    assert _codes(torch.bfloat16) == (["CW232"], "bfloat16")  # f32 gradients reduced in bf16
    assert _codes(torch.float32) == ([], "float32")  # the fix
    assert _codes(torch.bfloat16, torch.bfloat16) == ([], "bfloat16")  # computed in bf16: nothing more lost
