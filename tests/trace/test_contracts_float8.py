"""The float8 GEMM contract (aten._scaled_mm) per device: FP8 needs sm 8.9+, MX scales sm 10.0,
every dim a multiple of 16 on CUDA; the CPU kernel (measured here) takes any shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from castwise.trace.contracts import check, result_dtype

aten = torch.ops.aten
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _args(m: int, k: int, n: int, a: torch.dtype = E4M3, b: torch.dtype = E4M3) -> tuple[torch.Tensor, ...]:
    one = torch.tensor(1.0)
    return (torch.zeros(m, k, dtype=a), torch.zeros(n, k, dtype=b).t(), one, one)


@pytest.mark.parametrize("mkn", [(16, 32, 16), (7, 32, 16), (16, 24, 16), (16, 32, 8)])
def test_cpu_takes_any_shape_as_its_kernel_does(mkn: tuple[int, int, int]) -> None:
    args = _args(*mkn)
    kwargs = {"out_dtype": torch.bfloat16}
    assert torch._scaled_mm(*args, **kwargs).dtype == torch.bfloat16  # the real CPU kernel
    assert check(aten._scaled_mm.default, args, kwargs, "cpu") is None
    assert result_dtype(aten._scaled_mm.default, args, kwargs, "cpu") == torch.bfloat16
    assert result_dtype(aten._scaled_mm.default, args, {}, "cpu") == E4M3


def test_cuda_refuses_dims_that_are_not_multiples_of_16() -> None:
    ok = _args(7, 32, 16)  # M (rows of mat1) is free
    assert check(aten._scaled_mm.default, ok, {}, "cuda") is None
    v = check(aten._scaled_mm.default, _args(16, 24, 16), {}, "cuda")
    assert v is not None and v.kind == "fp8-shape" and v.culprits == (0,)
    assert v.message == "Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (16x24)."
    v = check(aten._scaled_mm.default, _args(16, 32, 8), {}, "cuda")
    assert v is not None and v.kind == "fp8-shape" and v.message == "mat2 shape (32x8) must be divisible by 16"


@pytest.mark.parametrize(
    ("device", "refused"), [("cuda:a100", True), ("cuda:t4", True), ("cuda:l4", False), ("cuda", False)]
)
def test_fp8_needs_compute_capability_8_9(device: str, refused: bool) -> None:
    v = check(aten._scaled_mm.default, _args(16, 32, 16), {}, device)
    assert (v is not None) == refused
    if v is not None:
        assert v.kind == "fp8-device" and "compute capability >= 9.0 or 8.9" in v.message


def test_mx_scales_need_blackwell_and_two_e5m2_are_refused() -> None:
    a, b, _, _ = _args(32, 64, 32)
    scales = torch.zeros(32, 2, dtype=torch.float8_e8m0fnu)
    for device, refused in (("cuda", True), ("cuda:l4", True), ("cuda:b200", False)):
        v = check(aten._scaled_mm.default, (a, b, scales, scales), {}, device)
        assert (v is not None) == refused, device
    v = check(aten._scaled_mm.default, _args(16, 32, 16, E5M2, E5M2), {}, "cuda")
    assert v is not None and v.message == "Multiplication of two Float8_e5m2 matrices is not supported"
    assert check(aten._scaled_mm.default, _args(16, 32, 16, E4M3, E5M2), {}, "cuda") is None


def test_a_rocm_class_multiplies_two_e5m2() -> None:
    """Blas.cpp keeps the e5m2 x e5m2 refusal under ``#ifndef USE_ROCM`` (pytorch#148228): MI355X
    (OCP float8) takes the pair that every CUDA class refuses."""
    e5m2 = _args(16, 32, 16, E5M2, E5M2)
    assert check(aten._scaled_mm.default, e5m2, {}, "cuda:mi355x") is None
    assert check(aten._scaled_mm.default, e5m2, {}, "cuda:h200") is not None


TRUTH = Path(__file__).parent / "truth" / "scaled_mm_h200.json"


def test_the_cuda_contract_predicts_a_real_h200() -> None:
    """Outcomes measured on an H200 (sm 9.0, torch 2.11, benchmarks/device/scaled_mm_truth.py):
    every accepted call accepted, every refusal refused in the kernel's own words."""
    truth = json.loads(TRUTH.read_text())
    assert truth["sm"] == [9, 0]
    for case in truth["cases"]:
        if case.get("mx"):
            # MX block scales on Hopper: refused (cuBLASLt has no such GEMM before sm 10.0)
            a = torch.zeros(128, 128, dtype=E4M3)
            scale = torch.zeros(128, 4, dtype=torch.float8_e8m0fnu)
            v = check(aten._scaled_mm.default, (a, a.t(), scale, scale), {}, "cuda")
            assert not case["ok"] and v is not None and v.kind == "fp8-device"
            continue
        fmt = {"e4m3": E4M3, "e5m2": E5M2}
        args = _args(case["m"], case["k"], case["n"], fmt[case["a"]], fmt[case["b"]])
        v = check(aten._scaled_mm.default, args, {"out_dtype": torch.bfloat16}, "cuda")
        if case["ok"]:
            assert v is None, case
        else:
            assert v is not None and v.message == case["error"], case
