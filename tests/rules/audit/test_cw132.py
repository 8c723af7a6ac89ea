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


def test_the_fix_is_another_recipe() -> None:
    from castwise.auditor.context import FixContext
    from castwise.report import Finding
    from castwise.rules.audit.cw132 import RULE

    fix = RULE.policy_fix
    assert fix is not None
    fx = FixContext(torch.bfloat16)

    def finding(kernel: str, has_fp8: bool) -> Finding:
        return Finding("CW132", "m", module="up", details=(("fp8_kernel", kernel), ("gpu_has_fp8", has_fp8)))

    mx = castwise.Policy.parse("mxfp8")
    assert fix(mx, finding("mx", True), fx) == castwise.Policy.parse("fp8")  # Hopper: tensorwise float8
    assert fix(mx, finding("mx", False), fx) == castwise.Policy.parse("bf16-mixed")  # an A100: no float8
    plain = castwise.Policy.parse("bf16-mixed")
    assert fix(plain, finding("fp8", False), fx) is plain  # a model converted by hand: no policy fixes it


def test_the_kernel_is_read_from_the_operands_dtypes_not_the_message() -> None:
    from castwise import devices
    from castwise.auditor.context import make_ctx
    from castwise.rules.audit.cw132 import RULE

    e4m3, e5m2, e8m0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu

    def kernel(dtypes: tuple[torch.dtype, ...], device: str) -> object:
        ctx = make_ctx(
            phase="forward",
            module="up",
            op="aten._scaled_mm",
            kind="fp8-device",
            text="refused",  # names no kernel: the rule must not need it to
            dtypes=dtypes,
            provs=(None,) * len(dtypes),
            culprits=[0, 1],
            is_fast=False,
            autocast=None,
            compute=torch.bfloat16,
            expected=None,
            device=devices.get(device),
        )
        diag = RULE.checks[0].match(ctx)
        assert diag is not None
        return dict(diag.details)["fp8_kernel"]

    assert kernel((e4m3, e4m3, e8m0, e8m0), "cuda") == "mx"  # MX block scales on Hopper
    assert kernel((e4m3, e4m3, torch.float32, torch.float32), "cuda:a100") == "fp8"
    assert kernel((e5m2, e5m2, torch.float32, torch.float32), "cuda") == "e5m2"
