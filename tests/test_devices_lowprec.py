"""The 2026 GPU classes: their float8 flavour, MX / NVFP4 support and kernel shape rules, and a
planted fault per class found by the audit before any GPU time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise
from castwise import devices
from castwise.trace.contracts.float8 import _scaled_mm

CLASSES = ("cuda:h200", "cuda:gb200", "cuda:sm120", "cuda:rtx5090", "cuda:mi300x", "cuda:mi355x")


@pytest.mark.parametrize("name", CLASSES)
def test_each_class_is_registered_with_its_low_precision(name: str) -> None:
    dev = devices.get(name)
    assert dev.kernels == "cuda" and dev.low is not None and dev.capability is not None


@pytest.mark.parametrize(
    ("name", "fp8", "mxfp8", "mxfp4", "nvfp4"),
    [
        ("cuda:h200", "float8_e4m3fn", False, False, False),
        ("cuda:gb200", "float8_e4m3fn", True, True, True),
        ("cuda:rtx5090", "float8_e4m3fn", True, True, True),
        ("cuda:mi300x", "float8_e4m3fnuz", False, False, False),
        ("cuda:mi355x", "float8_e4m3fn", True, True, False),
    ],
)
def test_formats_per_class(name: str, fp8: str, mxfp8: bool, mxfp4: bool, nvfp4: bool) -> None:
    low = devices.get(name).low_precision()
    assert low.fp8[0] == fp8
    assert (low.missing("mxfp8") is None, low.missing("mxfp4") is None, low.missing("nvfp4") is None) == (
        mxfp8,
        mxfp4,
        nvfp4,
    )
    assert devices.get(name).runs_float8(mx=True) == mxfp8


def test_older_devices_keep_their_capability_rules() -> None:
    assert devices.get("cuda:b200").low_precision().nvfp4
    assert not devices.get("cuda").low_precision().mx and devices.get("cuda").runs_float8()
    assert devices.get("cuda:a100").low_precision().missing("tensorwise") == "float8 GEMMs"


def _gemm(dev: str, dtype: torch.dtype, k: int, mx: bool = False) -> object:
    with torch.device("meta"):
        a, b = torch.empty(32, k, dtype=dtype), torch.empty(k, 32, dtype=dtype)
        scale = torch.empty(32, k // 32, dtype=torch.float8_e8m0fnu) if mx else torch.empty(())
    return _scaled_mm("aten._scaled_mm", (a, b, scale, scale), {"out_dtype": torch.bfloat16}, devices.get(dev))


def test_contract_refuses_the_other_float8_flavour() -> None:
    assert getattr(_gemm("cuda:mi300x", torch.float8_e4m3fn, 64), "kind", None) == "fp8-flavour"
    assert _gemm("cuda:mi300x", torch.float8_e4m3fnuz, 64) == torch.bfloat16
    assert getattr(_gemm("cuda:mi355x", torch.float8_e4m3fnuz, 64), "kind", None) == "fp8-flavour"
    assert _gemm("cuda:h200", torch.float8_e4m3fn, 64) == torch.bfloat16


def test_mi355x_mx_gemms_need_k_in_multiples_of_128() -> None:
    assert getattr(_gemm("cuda:mi355x", torch.float8_e4m3fn, 96, mx=True), "kind", None) == "mx-shape"
    assert _gemm("cuda:mi355x", torch.float8_e4m3fn, 128, mx=True) == torch.bfloat16
    assert _gemm("cuda:gb200", torch.float8_e4m3fn, 96, mx=True) == torch.bfloat16
    assert getattr(_gemm("cuda:h200", torch.float8_e4m3fn, 128, mx=True), "kind", None) == "fp8-device"


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))


@pytest.mark.parametrize(
    ("policy", "device", "code"),
    [
        ("nvfp4", "cuda:h200", "CW181"),
        ("mxfp4", "cuda:mi300x", "CW181"),
        ("nvfp4", "cuda:mi355x", "CW181"),
        ("mxfp8", "cuda:mi300x", "CW132"),
        ("mxfp8", "cuda:h200", "CW132"),
    ],
)
def test_a_planted_recipe_fault_per_class_is_found(policy: str, device: str, code: str) -> None:
    report = castwise.audit(_mlp(), torch.randn(2, 64, 128), policy=policy, device=device, mode="train")
    assert code in {f.code for f in report.errors}


@pytest.mark.parametrize(
    ("policy", "device"), [("nvfp4", "cuda:gb200"), ("nvfp4", "cuda:sm120"), ("mxfp4", "cuda:mi355x")]
)
def test_look_alikes_on_classes_that_run_them_are_clean(policy: str, device: str) -> None:
    report = castwise.audit(_mlp(), torch.randn(2, 64, 128), policy=policy, device=device, mode="train")
    assert not [f for f in report.errors if f.code in ("CW132", "CW180", "CW181")]


def test_nvfp4_on_hopper_suggests_its_float8() -> None:
    report = castwise.audit(_mlp(), torch.randn(2, 64, 128), policy="nvfp4", device="cuda:h200", mode="train")
    assert str(report.suggested_policy) == "fp8"


# -- castwise's own float8 conversion takes the class's flavour ------------------------------------


@pytest.mark.parametrize(
    ("device", "flavour"), [("cuda:mi300x", torch.float8_e4m3fnuz), ("cuda:h200", torch.float8_e4m3fn)]
)
@pytest.mark.parametrize("policy", ["fp8", "bf16-mixed,fp8=rowwise"])
def test_apply_converts_to_the_float8_flavour_of_the_class(device: str, flavour: torch.dtype, policy: str) -> None:
    pytest.importorskip("torchao")
    model = _mlp()
    applied = castwise.apply(model, policy, device=device)
    first = model[0]
    assert first.config.cast_config_input.target_dtype == flavour  # type: ignore[union-attr]
    assert first.config.cast_config_weight.target_dtype == flavour  # type: ignore[union-attr]
    model(torch.randn(4, 128)).sum().backward()  # emulated on CPU in that flavour
    applied.remove()
    assert isinstance(model[0], nn.Linear) and type(model[0]) is nn.Linear


def test_the_audit_of_castwise_fp8_on_mi300x_is_clean() -> None:
    pytest.importorskip("torchao")
    report = castwise.audit(_mlp(), torch.randn(2, 64, 128), policy="fp8", device="cuda:mi300x", mode="train")
    assert not [f for f in report.findings if f.code in ("CW180", "CW131", "CW132")]


# -- a planted float8 flavour / shape fault per GPU class, and its look-alike ----------------------


class _HandFP8(nn.Module):
    """A hand-written float8 GEMM (x @ w.T through torch._scaled_mm, per-tensor scales): what a
    custom recipe or a kernel library's Linear runs."""

    def __init__(self, k: int, a: torch.dtype, b: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, k) * 0.05)
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one = torch.ones((), device=x.device)
        a, b = x.reshape(-1, x.shape[-1]).to(self.a), self.w.to(self.b).t()
        return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)


def _codes(device: str, k: int, a: torch.dtype, b: torch.dtype) -> set[str]:
    report = castwise.audit(_HandFP8(k, a, b), torch.randn(32, k), device=device, mode="eval")
    return {f.code for f in report.findings}


GPU_CLASSES = [n for n in devices.names() if devices.get(n).kernels == "cuda" and devices.get(n).capability]


@pytest.mark.parametrize("device", GPU_CLASSES)
def test_a_planted_float8_fault_per_gpu_class_is_found_and_its_look_alike_is_clean(device: str) -> None:
    fp8 = devices.get(device).low_precision().fp8
    if not fp8:  # A100-type classes run no float8 GEMM at all: any is the fault
        assert "CW132" in _codes(device, 96, torch.float8_e4m3fn, torch.float8_e4m3fn)
        control = castwise.audit(nn.Linear(96, 64), torch.randn(32, 96), policy="bf16-mixed", device=device)
        assert not [f for f in control.errors if f.code in ("CW131", "CW132", "CW180")]
        return
    own = getattr(torch, fp8[0])
    other = torch.float8_e4m3fn if fp8[0].endswith("fnuz") else torch.float8_e4m3fnuz
    assert "CW180" in _codes(device, 96, other, other)  # the other vendor's flavour
    assert "CW131" in _codes(device, 100, own, own)  # K not a multiple of 16
    assert not _codes(device, 96, own, own) & {"CW131", "CW132", "CW180"}  # the look-alike


@pytest.mark.parametrize("device", GPU_CLASSES)
def test_nvfp4_is_found_where_the_class_has_no_nvfp4_gemm(device: str) -> None:
    report = castwise.audit(_mlp(), torch.randn(2, 64, 128), policy="nvfp4", device=device, mode="train")
    faults = {f.code for f in report.errors} & {"CW181", "CW132", "CW180", "CW131"}
    assert bool(faults) == (not devices.get(device).low_precision().nvfp4)


class _HandNVFP4(nn.Module):
    """A hand-written NVFP4 GEMM: E2M1 operands (two a byte) with swizzled e4m3 block scales, one
    per 16 elements in 128x4 tiles (torch's test_scaled_matmul_cuda layout)."""

    def __init__(self, m: int = 128, k: int = 128, n: int = 128) -> None:
        super().__init__()
        self.m, self.k = m, k
        self.w = nn.Parameter(torch.zeros(n, k // 2, dtype=torch.uint8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.zeros(self.m, self.k // 2, dtype=torch.uint8, device=x.device).view(torch.float4_e2m1fn_x2)
        b = self.w.view(torch.float4_e2m1fn_x2).t()
        tiles = -(-self.k // 16 // 4) * 4
        sa = torch.ones(-(-self.m // 128) * 128 * tiles, device=x.device).to(torch.float8_e4m3fn)
        sb = torch.ones(-(-b.shape[1] // 128) * 128 * tiles, device=x.device).to(torch.float8_e4m3fn)
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16) + x.sum() * 0


@pytest.mark.parametrize("device", GPU_CLASSES)
def test_a_hand_written_nvfp4_gemm_is_refused_where_the_class_has_none(device: str) -> None:
    report = castwise.audit(_HandNVFP4(), torch.randn(4), device=device, mode="eval")
    refused = "CW132" in {f.code for f in report.findings}
    assert refused == (not devices.get(device).low_precision().nvfp4)  # gb200 / sm120: the clean look-alike
