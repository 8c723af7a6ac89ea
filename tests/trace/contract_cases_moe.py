"""Mixture-of-experts cases for the contract differential test (contract_cases.py runs them):
grouped matrix products, the experts' histogram and the router's mask negation, on real CPU
kernels. Torch's fake kernel for ``_grouped_mm`` refuses f32, which the real kernels accept."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from .contract_cases import BF16, BOOL, F16, F32, F64, I32, I64, U8, Case, aten, t, tag

# two experts, eight rows each: CUDA's grouped GEMM wants every group's rows (and the inner sizes)
# a multiple of 16 bytes, and a misaligned case is a device-side assert that ends the CUDA context
_OFFS = (8, 16)


def _offs() -> torch.Tensor:
    return torch.tensor(_OFFS, dtype=I32)


def _grouped(a: torch.dtype, b: torch.dtype) -> Case:
    return Case(
        f"_grouped_mm-2d3d[{tag(a, b)}]",
        "moe",
        aten._grouped_mm.default,
        lambda: ((t((16, 8), a), t((2, 8, 8), b), _offs()), {}),
    )


def moe_cases() -> Iterator[Case]:
    for a, b in itertools.product((F32, BF16, F16, F64), (F32, BF16, F16, F64)):
        yield _grouped(a, b)
    for d in (F32, BF16):
        yield Case(
            f"_grouped_mm-3d3d[{tag(d, d)}]",
            "moe",
            aten._grouped_mm.default,
            lambda d=d: ((t((2, 4, 8), d), t((2, 8, 8), d)), {}),
        )
        yield Case(
            f"_grouped_mm-2d2d[{tag(d, d)}]",
            "moe",
            aten._grouped_mm.default,
            lambda d=d: ((t((8, 16), d), t((16, 8), d), torch.tensor((8, 16), dtype=I32)), {}),
        )
    yield Case(
        "_grouped_mm-3d3d[bf16-f32]",
        "moe",
        aten._grouped_mm.default,
        lambda: ((t((2, 4, 8), BF16), t((2, 8, 8), F32)), {}),
    )
    yield Case(
        "_grouped_mm-out_dtype[bf16-bf16-f32]",
        "moe",
        aten._grouped_mm.default,
        lambda: ((t((16, 8), BF16), t((2, 8, 8), BF16), _offs()), {"out_dtype": F32}),
    )
    yield Case(
        "_grouped_mm-out_dtype[bf16-bf16-bf16]",
        "moe",
        aten._grouped_mm.default,
        lambda: ((t((16, 8), BF16), t((2, 8, 8), BF16), _offs()), {"out_dtype": BF16}),
    )
    for d in (F64, I32, I64, U8, BOOL):
        yield Case(
            f"histc-bins[{tag(d)}]",
            "moe",
            aten.histc.default,
            lambda d=d: ((torch.tensor([0, 1, 1, 3]).to(d),), {"bins": 4, "min": 0, "max": 3}),
        )
    for d in (BOOL, I64, U8, F32, BF16):
        yield Case(f"bitwise_not[{tag(d)}]", "moe", aten.bitwise_not.default, lambda d=d: ((t((3,), d),), {}))
