"""CW132 fp8-unsupported-on-gpu: a target GPU without FP8 (or MX) GEMMs is a finding, fixed by
another recipe."""

from __future__ import annotations

import torch
from torch import nn

import castwise


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def test_fp8_on_an_a100_is_a_finding_and_bf16_the_suggestion() -> None:
    report = castwise.audit(_mlp(), torch.randn(2, 8, 64), policy="fp8", device="cuda:a100", mode="train")
    codes = {f.code for f in report.errors}
    assert codes == {"CW132"}
    f = report.errors[0]
    assert f.module == "0" and "cuda:a100 (compute capability 8.0) cannot run" in f.message
    assert dict(f.details)["fp8_kernel"] == "fp8" and dict(f.details)["gpu_has_fp8"] is False
    assert dict(f.details)["also_at"] == ["2"]
    assert str(report.suggested_policy) == "bf16-mixed"


def test_fp8_on_ada_and_hopper_is_clean() -> None:
    for device in ("cuda:l4", "cuda", "cuda:b200"):
        assert castwise.audit(_mlp(), torch.randn(2, 8, 64), policy="fp8", device=device, mode="train").ok
