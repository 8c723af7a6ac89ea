"""Mixture-of-experts models audit to completion on fake tensors (cpu and simulated cuda) and
real CPU tensors, with no error finding; a real grouped-GEMM dtype error is still found, worded
as the real CPU kernel words it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn

import castwise
from castwise.auditor.session import run_audit
from castwise.trace import fastpath
from castwise.trace.contracts._base import TORCH_RELEASE


def _mixtral(experts: str = "grouped_mm") -> nn.Module:
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    cfg._experts_implementation = experts
    return transformers.MixtralForCausalLM(cfg)


def _qwen3_moe() -> nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def _deepseek_v3() -> nn.Module:
    cfg = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )
    return transformers.DeepseekV3ForCausalLM(cfg)


BUILDERS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}
SETUPS = [("cpu", True), ("cuda", True), ("cpu", False)]


def _inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize(("device", "fake"), SETUPS, ids=["fake-cpu", "fake-cuda", "real-cpu"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_moe_models_audit_to_completion_with_no_error(name: str, device: str, fake: bool) -> None:
    torch.manual_seed(0)
    report = castwise.audit(BUILDERS[name](), _inputs(), policy="bf16-mixed", device=device, fake=fake)
    assert report.ok, str(report)
    assert [r.status for r in report.runs] == ["ok", "ok"]
    assert not [f for f in report.findings if f.code in ("CW901", "CW902")], str(report)


def test_the_grouped_gemm_runs_in_f32_where_torchs_fake_kernel_refuses_it() -> None:
    # the regression: the fake (meta) kernel says "Expected mat_a to be BFloat16 ...", a CUDA-only
    # restriction the real kernels do not have; the audit stood on it and reported a false CW102
    report, runs = run_audit(_mixtral(), _inputs(), None, "cpu", "eval", True)
    grouped = [op for op in runs[0].trace.ops if op[1] == "aten._grouped_mm"]
    assert grouped and all(ins[0][0] == torch.float32 for _m, _o, _p, ins, _outs in grouped)
    assert report.ok and not report.findings, str(report)


def test_the_eager_experts_loop_runs_every_expert_and_says_what_it_assumed() -> None:
    report = castwise.audit(_mixtral("eager"), _inputs(), policy="bf16-mixed", device="cuda")
    assert report.ok, str(report)
    cw903 = next(f for f in report.findings if f.code == "CW903")
    assumed = dict(cw903.details)["assumed_sizes"]
    assert {a["module"] for a in assumed} == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert "nonzero" in cw903.message


class _GroupedExperts(nn.Module):
    """Experts whose weights stay f32 while the tokens come in bf16: the grouped GEMM refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([2, 4], dtype=torch.int32, device=x.device)
        return torch._grouped_mm(x.to(torch.bfloat16), self.weight, offs=offs)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_real_grouped_gemm_dtype_error_is_found_in_the_kernels_words(device: str) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError) as real:
        _GroupedExperts()(x)
    report = castwise.audit(_GroupedExperts(), x, device=device, mode="eval")
    errors = report.errors
    assert errors and errors[0].op == "aten._grouped_mm", str(report)
    words = "mat1 and mat2" if device == "cuda" else "m1 and m2"
    if TORCH_RELEASE >= (2, 15):  # validated up front since 2.15, in the grouped GEMM's own words
        assert "Expected mat_a and mat_b to have the same dtype" in errors[0].message
    else:
        assert f"expected {words} to have the same dtype" in errors[0].message
    if device == "cpu":
        assert str(real.value).splitlines()[0] in errors[0].message
    assert castwise.audit(_GroupedExperts(), x, device="cpu", mode="eval", fake=False).errors[0].code == errors[0].code


def test_the_simulated_cuda_capability_is_visible_only_during_the_audit() -> None:
    seen: list[Any] = []

    class Asks(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.cuda.get_device_capability(x.device))
            return x * 2

    assert castwise.audit(Asks(), torch.randn(2), device="cuda", mode="eval").ok
    assert seen == [(9, 0)]
    assert torch.cuda.get_device_capability.__module__ == "torch.cuda"


def test_the_own_fake_grouped_gemm_has_the_real_kernels_shapes() -> None:
    a, b, offs = torch.randn(4, 8), torch.randn(2, 8, 8), torch.tensor([2, 4], dtype=torch.int32)
    for args in (
        (a, b, offs),
        (torch.randn(2, 4, 8), b),
        (torch.randn(8, 8), torch.randn(8, 8), torch.tensor([4, 8], dtype=torch.int32)),
    ):
        real = torch._grouped_mm(*args)
        fake = fastpath.run_grouped_mm(torch.ops.aten._grouped_mm.default, args, {})
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def _fake_grouped_mm_refuses_f32() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(4, 8), torch.empty(2, 8, 8)
        offs = torch.tensor([2, 4], dtype=torch.int32)
        try:
            torch.ops.aten._grouped_mm(a, b, offs)
        except Exception:  # the meta kernel's refusal (its type varies by release)
            return True
    return False


def test_a_fake_kernel_stricter_than_the_table_is_a_simulation_limit_not_a_real_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without castwise's own fake grouped GEMM, torch's fake kernel refuses f32 ("Expected mat_a to
    # be BFloat16 ..."); the table says both real kernels accept f32: no "Real error" is claimed
    monkeypatch.delitem(fastpath.OWN_FAKE, torch.ops.aten._grouped_mm.default)
    report = castwise.audit(_mixtral(), _inputs(), device="cpu", mode="eval")
    assert not report.errors, str(report)
    if not _fake_grouped_mm_refuses_f32():  # torch's fake kernel takes f32 on this release (2.15+)
        assert report.ok, str(report)
        return
    stop = next(f for f in report.findings if f.code == "CW902")
    assert stop.op == "aten._grouped_mm" and "does not predict" in stop.message
    assert not report.ok and [r.status for r in report.runs] == ["incomplete"]
