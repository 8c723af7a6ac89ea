"""castwise.audit on models wrapped by FSDP1 (FullyShardedDataParallel), in this process:
torch.distributed's fake process group (rank 0 of N). Each verdict is checked against the
wrapped model run for real on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import castwise
from castwise.errors import AuditError
from tests.distributed._group import fake_process_group

WORLD = 4
BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def fake_group() -> Iterator[None]:
    with fake_process_group(WORLD):
        yield


class Block(nn.Module):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = norm(16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) * self.scale


def _wrapped(
    norm: type[nn.Module] = nn.LayerNorm, buffers: torch.dtype | None = BF16, orig: bool = True
) -> FullyShardedDataParallel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Block(norm), Block(norm), nn.Linear(16, 4))
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=buffers)
    return FullyShardedDataParallel(
        model,
        mixed_precision=mp,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
        use_orig_params=orig,
    )


def _runs(model: nn.Module, x: torch.Tensor) -> bool:
    """The wrapped model's real train step (forward + backward) and eval forward, on CPU."""
    try:
        model.train()
        model(x).float().sum().backward()
        model.eval()
        with torch.no_grad():
            model(x)
    except RuntimeError:
        return False
    finally:
        model.train()
    return True


@pytest.mark.parametrize("orig", [True, False], ids=["orig-params", "flat-params"])
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.BatchNorm1d])
def test_a_wrapped_model_that_trains_audits_clean_with_its_units(orig: bool, norm: type[nn.Module]) -> None:
    """Parameters gathered in bf16, buffers cast to bf16, the root's input cast; batch norm runs
    in a wrapper of its own with mixed precision off (inputs to f32 and back): all as the real run."""
    x = torch.randn(4, 16)
    assert _runs(_wrapped(norm, orig=orig), x)
    report = castwise.audit(_wrapped(norm, orig=orig), x)
    assert report.ok and not report.errors, str(report)
    units = {u["unit"]: u for u in report.to_dict()["units"]}
    expected = {"(root)", "1", "2"} | ({"1.norm", "2.norm"} if norm is nn.BatchNorm1d else set())
    assert set(units) == expected  # the user's names: no `_fsdp_wrapped_module`
    assert units["1"]["gather"] == "bf16" and units["1"]["reduce"] == "f32"
    assert units["(root)"]["inputs"] == "bf16"
    if norm is nn.BatchNorm1d:
        assert units["1.norm"]["gather"] == "f32" and units["1.norm"]["inputs"] == "f32"
    assert all("_fsdp_wrapped_module" not in (f.module or "") for f in report.findings)
    assert "FSDP1 over 4 ranks" in report.title


@pytest.mark.parametrize("orig", [True, False], ids=["orig-params", "flat-params"])
def test_buffers_left_f32_by_fsdp1_are_found_where_the_real_run_fails(orig: bool) -> None:
    """Without ``buffer_dtype`` the f32 ``scale`` buffer promotes a block's output to f32, and the
    next block's bf16 Linear refuses it: the real error, found at the same module."""
    x = torch.randn(4, 16)
    assert not _runs(_wrapped(buffers=None, orig=orig), x)
    report = castwise.audit(_wrapped(buffers=None, orig=orig), x)
    assert not report.ok
    assert report.errors[0].module == "2.lin", str(report)
    assert {r.mode for r in report.runs} == {"train", "eval"}


def test_the_audit_leaves_the_wrapped_model_as_it_was() -> None:
    model = _wrapped()
    x = torch.randn(4, 16)
    before = {n: (p.dtype, p.shape, p.data_ptr()) for n, p in model.named_parameters()}
    castwise.audit(model, x)
    assert {n: (p.dtype, p.shape, p.data_ptr()) for n, p in model.named_parameters()} == before
    assert model(x).dtype == BF16  # FSDP1's hooks still run it


def test_a_policy_for_a_wrapped_model_is_refused() -> None:
    with pytest.raises(AuditError, match="wrapped by FSDP1: its wrappers' MixedPrecision decide the dtypes"):
        castwise.audit(_wrapped(), torch.randn(4, 16), policy="bf16-mixed")


class Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 16)
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # checkpointed inside the unit: recomputed in backward, where FSDP gathers again
        h = torch.utils.checkpoint.checkpoint(self.inner, self.proj(x), use_reentrant=False)
        return h + self.emb(x)


class CallsOut(nn.Module):
    """The root calls the first block's ``emb`` after the blocks ran (DiT's forward does so)."""

    def __init__(self, call_out: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Emb(), Emb()])
        self.head = nn.Linear(16, 4)
        self.call_out = call_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = block(h)
        return self.head(h + self.blocks[0].emb(x) if self.call_out else h)


@pytest.mark.parametrize(
    ("strategy", "orig", "call_out", "fails"),
    [
        ("FULL_SHARD", True, True, True),
        ("FULL_SHARD", False, True, True),
        ("SHARD_GRAD_OP", False, True, False),
        ("FULL_SHARD", True, False, False),
    ],
)
def test_a_units_module_called_after_the_unit_freed_its_parameters_is_found(
    strategy: str, orig: bool, call_out: bool, fails: bool
) -> None:
    """FULL_SHARD frees a unit's gathered parameters after its forward: the root's call meets the
    shards and the real run fails (CW126 at the called module). SHARD_GRAD_OP keeps them gathered
    (flat parameters, both modes), and the checkpointed recompute in backward is gathered by FSDP:
    those run. (SHARD_GRAD_OP with original parameters under no_grad shows the shards too: that
    eval failure is not reported, the audit takes SHARD_GRAD_OP as keeping them.)"""
    from torch.distributed.fsdp import ShardingStrategy

    def wrap() -> FullyShardedDataParallel:
        torch.manual_seed(0)
        mp = MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
        return FullyShardedDataParallel(
            CallsOut(call_out),
            mixed_precision=mp,
            auto_wrap_policy=ModuleWrapPolicy({Emb}),
            sharding_strategy=ShardingStrategy[strategy],
            device_id=torch.device("cpu"),
            use_orig_params=orig,
        )

    x = torch.randn(4, 16)
    assert _runs(wrap(), x) is not fails
    report = castwise.audit(wrap(), x)
    found = [(f.code, f.module, f.modes) for f in report.errors]
    assert found == ([("CW126", "blocks.0.emb", ("train", "eval"))] if fails else []), str(report)


def test_accelerates_autocast_forward_under_fsdp1_is_what_the_view_runs() -> None:
    """Accelerate patches the model's forward (autocast, outputs to f32) before wrapping it: the
    view runs that forward, and the model's bf16 @ f32 product is fine under it, as for real."""
    import accelerate
    from accelerate.state import AcceleratorState

    class NeedsAutocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(Block(nn.LayerNorm), Block(nn.LayerNorm))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x) @ torch.eye(16)

    def wrapped() -> FullyShardedDataParallel:
        torch.manual_seed(0)
        model = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare_model(NeedsAutocast())
        mp = MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=BF16)
        return FullyShardedDataParallel(
            model, mixed_precision=mp, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )

    # a state an earlier test left (HF TrainingArguments makes one) would refuse this precision
    AcceleratorState._reset_state(reset_partial_state=True)
    x = torch.randn(4, 16)
    try:
        assert _runs(wrapped(), x)
        report = castwise.audit(wrapped(), x)
        assert report.ok and not report.errors, str(report)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
