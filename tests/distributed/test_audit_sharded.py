"""castwise.audit on FSDP2-sharded models, in this process: torch.distributed's fake process
group (rank 0 of N, collectives do nothing) and fake tensors, so any world size and model size."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import castwise
import castwise.fsdp2
from castwise.auditor.entry import audit_sharded
from castwise.errors import AuditError
from tests.distributed._group import fake_process_group
from tests.distributed._workers import tiny_llama

WORLD = 4


@pytest.fixture(scope="module", autouse=True)
def fake_group() -> Iterator[None]:
    with fake_process_group(WORLD):
        yield


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))


def _units(report: castwise.Report) -> dict[str, dict[str, Any]]:
    return {u["unit"]: u for u in report.to_dict()["units"]}


class Mix(nn.Module):
    """Makes a float32 tensor in forward (the default dtype) and multiplies bf16 activations by it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(x.shape[-1], x.shape[-1])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.mix = Mix()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.norm(self.proj(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_sharded_llama_reports_per_unit_gather_compute_and_reduce_dtypes() -> None:
    model = tiny_llama()
    castwise.fsdp2.fully_shard(model, "bf16-true")
    report = castwise.audit(model, _ids())
    units = _units(report)
    assert report.ok and [r.status for r in report.runs] == ["ok", "ok"]
    assert "FSDP2 over 4 ranks" in report.title
    island = units["model.layers.0.input_layernorm"]
    assert (island["kind"], island["gather"], island["compute"], island["reduce"], island["output"]) == (
        "island",
        "f32",
        "f32",
        "f32",
        "bf16",
    )
    block = units["model.layers.0"]
    assert (block["kind"], block["stored"], block["gather"], block["reduce"]) == ("block", "bf16", "bf16", "f32")
    assert list(units)[-1] == "(root)"
    assert "units (stored / gather / compute / reduce / output):" in str(report)


def test_findings_are_those_of_the_unsharded_model_under_the_same_policy() -> None:
    policy = "bf16-true"
    unsharded = castwise.audit(Net(), torch.randn(2, 8), policy=policy)
    model = Net()
    castwise.fsdp2.fully_shard(model, policy)
    sharded = castwise.audit(model, torch.randn(2, 8))
    assert not unsharded.ok
    key = sorted((f.code, f.module, f.modes) for f in unsharded.findings)
    assert sorted((f.code, f.module, f.modes) for f in sharded.findings) == key
    assert any(f.code == "CW106" and f.module == "blocks.0.mix" for f in sharded.findings)
    # a tensor made in forward with the default dtype: the unsharded model's fix search verifies the
    # default dtype in bf16; the sharded model's policy is its sharding's, and none is suggested
    assert str(unsharded.suggested_policy) == "bf16-true,default_dtype=bf16" and sharded.suggested_policy is None


class Up(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 2  # an f32 result nobody casts back


class UpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.up = Up()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.proj(x))


class UpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([UpBlock(), UpBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


def test_the_suggestion_is_a_sharding_policy_verified_by_a_re_audit() -> None:
    model = UpNet()
    unsharded = castwise.audit(model, torch.randn(2, 8), policy="bf16-true")
    castwise.fsdp2.fully_shard(model, "bf16-true")
    sharded = castwise.audit(model, torch.randn(2, 8))
    assert [(f.code, f.module) for f in sharded.findings] == [(f.code, f.module) for f in unsharded.findings]
    block = _units(sharded)["blocks.0"]  # compute is observed: the block's output comes out f32
    assert (block["gather"], block["compute"]) == ("bf16", "f32")
    fix = sharded.suggested_policy  # for castwise.fsdp2.fully_shard: the sharding policy plus a rule
    assert fix is not None and str(fix) == "bf16-true,out[blocks.*.up]=bf16"


def test_the_audit_leaves_the_sharded_model_as_it_was() -> None:
    model = tiny_llama()
    castwise.fsdp2.fully_shard(model, "bf16-mixed")
    before = {n: (type(p), p.dtype, p.to_local().data_ptr()) for n, p in model.named_parameters()}
    hooks = {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()}
    castwise.audit(model, _ids(), device="cuda", mode="train")
    assert {n: (type(p), p.dtype, p.to_local().data_ptr()) for n, p in model.named_parameters()} == before
    assert {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()} == hooks
    assert all(isinstance(p, DTensor) for p in model.parameters()) and isinstance(model, FSDPModule)


def test_a_model_sharded_by_torch_is_read_from_its_fsdp_states() -> None:
    model = tiny_llama()
    low = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce_dtype None: reduces in bf16
    for layer in model.model.layers:
        torch_fully_shard(layer, mp_policy=low)
    torch_fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    report = castwise.audit(model, _ids(), mode="train")
    units = _units(report)
    assert set(units) == {"model.layers.0", "model.layers.1", "(root)"}
    assert (units["model.layers.0"]["gather"], units["model.layers.0"]["reduce"]) == ("bf16", "bf16")
    assert units["(root)"]["output"] == "f32" and units["(root)"]["kind"] == "root"
    with pytest.raises(AuditError, match="policy=None"):
        castwise.audit(model, _ids(), policy="bf16-mixed")


def test_a_plan_audits_before_anything_is_sharded() -> None:
    report = audit_sharded(tiny_llama(), _ids(), policy="bf16-mixed,keep[class:LlamaRMSNorm]=f32", world_size=64)
    units = _units(report)
    assert report.ok and "FSDP2 plan over 64 ranks" in report.title
    assert units["model.norm"]["gather"] == "f32" and units["model.layers.1"]["gather"] == "bf16"
    assert units["(root)"]["bytes_per_rank"] * 64 >= units["(root)"]["params"] * 4
    with pytest.raises(AuditError, match="not sharded by FSDP2"):
        audit_sharded(tiny_llama(), _ids())


def test_a_70b_shaped_slice_over_64_ranks_audits_in_little_memory() -> None:
    """The benchmark (benchmarks/bench_fsdp2_70b.py: 80 layers, 64 ranks) at 2 layers over a mesh of its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=2,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    group = dist.new_group(list(range(WORLD)))  # the fake backend answers for any rank list
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, "cpu")
    castwise.fsdp2.fully_shard(model, "bf16-true", mesh=mesh)
    report = castwise.audit(model, torch.randint(0, 128256, (1, 8)), device="cuda", mode="train")
    units = _units(report)
    assert report.ok and len(units) == 2 * 3 + 1 + 1
    embed = config.vocab_size * config.hidden_size
    assert units["(root)"]["bytes_per_rank"] == -(-(2 * embed) // WORLD) * 2  # embeddings + head, bf16
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2**20  # KiB: far from 1.9B real weights


def test_an_island_without_parameters_is_cast_by_castwise_not_gathered() -> None:
    model = tiny_llama()
    castwise.fsdp2.fully_shard(model, "bf16-true,keep[**.act_fn]=f32")
    act = model.model.layers[0].mlp.act_fn
    assert not isinstance(act, FSDPModule) and getattr(act.forward, "__castwise_fsdp2__", False)
    report = castwise.audit(model, _ids(), mode="train")
    units = _units(report)
    assert report.ok and units["model.layers.0.mlp.act_fn"]["kind"] == "island"
    assert (units["model.layers.0.mlp.act_fn"]["params"], units["model.layers.0.mlp.act_fn"]["inputs"]) == (0, "f32")


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


@pytest.mark.parametrize("odd", ["trainable", "frozen", "none"])
def test_a_unit_with_mixed_parameter_dtypes_is_found_before_fsdp2_refuses_it(odd: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Unit(), _Unit())
    if odd != "none":
        model[1].norm.double()  # one module left in f64 inside a unit
        model[1].norm.requires_grad_(odd == "trainable")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in model:
        torch_fully_shard(unit, mp_policy=mp)
    torch_fully_shard(model, mp_policy=mp)
    x = torch.randn(2, 8)
    report = castwise.audit(model, x, mode="train")
    found = [f for f in report.errors if "uniform original parameter dtype" in f.message]
    if odd == "trainable":
        with pytest.raises(AssertionError, match="uniform original parameter dtype"):
            model(x)  # torch refuses it at the unit's first forward
        assert [(f.code, f.module) for f in found] == [("CW113", "1.norm")], str(report)
        assert found[0].origin is not None and found[0].origin.module == "1.norm"
    else:
        model(x).float().sum().backward()  # FSDP2 checks trainable parameters only: this runs
        assert not found, str(report)


class _Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.emb(x)


class _CallsOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Emb(), _Emb()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = block(h)
        return h + self.blocks[0].emb(x)  # the first unit's module, from the root, after it ran


@pytest.mark.parametrize("reshard", [True, False])
def test_a_units_module_called_from_outside_the_unit_is_found_where_fsdp2_fails(reshard: bool) -> None:
    """After its forward an FSDP2 unit frees its gathered parameters (reshard_after_forward=True):
    the root's call meets DTensors and fails, CW126 at the called module. A unit that keeps them
    (reshard_after_forward=False) runs the call in train mode, and the audit says nothing."""

    def sharded() -> nn.Module:
        torch.manual_seed(0)
        model = _CallsOut()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            torch_fully_shard(block, mp_policy=mp, reshard_after_forward=reshard)
        torch_fully_shard(model, mp_policy=mp)
        return model

    x = torch.randn(2, 8)
    try:
        sharded()(x).float().sum().backward()
        real_fails = False
    except RuntimeError as exc:
        assert "DTensor" in str(exc)
        real_fails = True
    assert real_fails is reshard
    report = castwise.audit(sharded(), x, mode="train")
    assert [(f.code, f.module) for f in report.errors] == ([("CW126", "blocks.0.emb")] if reshard else [])


def test_blocks_compiled_before_fully_shard_are_audited_as_the_blocks() -> None:
    """torchtitan compiles each block, then shards it: the view holds the blocks themselves (a
    copy of an OptimizedModule is rebuilt around the block and lost the unit's casts), so the
    units' boundaries hold, nothing is reported as called outside its unit, and no name has
    `_orig_mod`."""

    def sharded() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block(), nn.Linear(8, 4))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i in (0, 1):
            model[i] = torch.compile(model[i])
            torch_fully_shard(model[i], mp_policy=mp)
        torch_fully_shard(model, mp_policy=mp)
        return model

    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="dtype"):  # Mix's f32 ones meet bf16, for real
        sharded()(x).float().sum().backward()
    report = castwise.audit(sharded(), x, mode="train")
    assert [(f.code, f.module) for f in report.errors] == [("CW106", "0.mix")], str(report)
    assert all("_orig_mod" not in (f.module or "") for f in report.findings)
    assert set(_units(report)) == {"0", "1", "(root)"}


class _NeedsAutocast(nn.Module):
    """Its root multiplies a unit's bf16 output by an f32 constant: only autocast makes that run."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) @ torch.eye(8))


def test_accelerates_autocast_forward_on_a_sharded_model_is_what_the_view_runs() -> None:
    """Accelerate's prepare_model sets the instance's forward to its autocast and f32-output
    wrapper, bound to the model. The view ran the class's forward (and its copy dragged the
    user's FSDP module along: 'FSDP does not support deepcopy'); it now runs the instance's."""
    import accelerate
    from accelerate.state import AcceleratorState

    def sharded(autocast: bool) -> nn.Module:
        torch.manual_seed(0)
        model: nn.Module = _NeedsAutocast()
        if autocast:
            model = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        torch_fully_shard(model.a, mp_policy=mp)
        torch_fully_shard(model, mp_policy=mp)
        return model

    # a state an earlier test left (HF TrainingArguments makes one) would refuse this precision
    AcceleratorState._reset_state(reset_partial_state=True)
    x = torch.randn(2, 8)
    try:
        assert "forward" in sharded(True).__dict__  # Accelerate's own wrapper
        assert sharded(True)(x).dtype == torch.float32  # runs, its output cast to f32
        with pytest.raises(RuntimeError, match="dtype"):  # without the autocast it does not
            sharded(False)(x)
        report = castwise.audit(sharded(True), x)
        assert report.ok and not report.errors, str(report)
        assert [f.code for f in castwise.audit(sharded(False), x).errors] == ["CW106"]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


class QKNorm(nn.Module):
    """A projection into nn.RMSNorm (aten::rms_norm: on CUDA autocast's f32 list from torch 2.12)
    under the model's own autocast (FSDP2 enters none: the release shows only where the model does)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.norm(self.q(x))


def test_a_sharded_audit_runs_the_units_as_the_given_torch_release() -> None:
    from castwise import _releases as releases

    before = [r for r in releases.recorded() if releases.load(r).category("cuda", "aten::rms_norm") is None]
    assert before, "a recorded release before rms_norm joined CUDA autocast's f32 list (2.11)"
    outputs = {}
    for release in (before[-1], releases.recorded()[-1]):
        report = audit_sharded(
            QKNorm(), torch.randn(2, 8), policy="bf16-mixed", device="cuda", mode="eval", world_size=2, torch=release
        )
        outputs[release] = next(m["outputs"] for m in report.summary["modules"] if m["name"] == "norm")
    assert outputs == {before[-1]: ["bf16[2, 8]"], releases.recorded()[-1]: ["f32[2, 8]"]}
    with pytest.raises(releases.TorchReleaseError, match="valid: "):
        audit_sharded(QKNorm(), torch.randn(2, 8), policy="bf16-mixed", torch="2.9")


def test_an_optimizer_given_with_a_sharded_model_is_refused_with_what_to_do_instead() -> None:
    # the step's storage and reduce dtypes are FSDP2's per parameter: a ledger from the unsharded step would be wrong
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    torch_fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(AuditError, match="castwise run"):
        castwise.audit(model, torch.randn(2, 16), mode="train", optimizer=torch.optim.AdamW)
    assert not castwise.audit(model, torch.randn(2, 16), mode="train").errors
