"""CW131 fp8-gemm-shape on simulated CUDA, before any GPU time: a float8 Linear's features, and
the token count only the backward's weight-gradient GEMM multiplies over (pytorch/ao#3111)."""

from __future__ import annotations

import torch
from benchmarks.zoo import models as zoo
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import castwise


def _mlp(hidden: int = 128) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, 64))


def _codes(report: castwise.Report) -> list[str]:
    return [f.code for f in report.findings]


def test_a_feature_dim_off_16_in_a_user_converted_model() -> None:
    model = _mlp(hidden=72)
    convert_to_float8_training(model, config=Float8LinearConfig())  # no filter: 72 is converted
    report = castwise.audit(model, torch.randn(2, 8, 64), policy="bf16-mixed", device="cuda", mode="train")
    (f,) = [f for f in report.findings if f.code == "CW131"]
    assert f.module == "0" and f.op == "aten._scaled_mm" and dict(f.details)["gemm_dim"] == "features"
    assert "mat2 shape (64x72)" in f.message and "Leave `0` out of float8" in f.fix
    assert "CW130" not in _codes(report)


def test_the_token_dim_under_castwises_fp8_policy_is_found_in_backward() -> None:
    model = _mlp()
    report = castwise.audit(model, torch.randn(2, 7, 64), policy="fp8", device="cuda", mode="train")
    errors = [f for f in report.findings if f.level == "error"]
    assert [(f.code, f.module) for f in errors] == [("CW131", "2")]
    assert dict(errors[0].details)["gemm_dim"] == "tokens"
    assert "batch's tokens" in errors[0].message and "pad_to_multiple_of=16" in errors[0].fix
    assert type(model[0]) is nn.Linear  # the audit converted its own copy


def test_clean_where_every_dim_is_a_multiple_and_on_the_cpu() -> None:
    model = _mlp()
    clean = castwise.audit(model, torch.randn(2, 8, 64), policy="fp8", device="cuda", mode="train")
    assert clean.ok and not clean.findings  # _scaled_mm has a contract: no CW901 either
    cpu = castwise.audit(model, torch.randn(2, 7, 64), policy="fp8", device="cpu", mode="train")
    assert cpu.ok  # CPU: emulated float8, and the CPU kernel takes any shape


def test_a_zoo_llama_under_fp8_on_simulated_cuda() -> None:
    model, _ = zoo.build("llama")
    ok = castwise.audit(model, {"input_ids": zoo.ids(8)}, policy="fp8", device="cuda", mode="train")
    assert ok.ok
    bad = castwise.audit(model, {"input_ids": zoo.ids(7)}, policy="fp8", device="cuda", mode="train")
    assert {f.code for f in bad.errors} == {"CW131"}
    assert all(dict(f.details)["gemm_dim"] == "tokens" for f in bad.errors)
