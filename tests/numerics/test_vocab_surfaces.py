"""Policy.parse, compare and forecast read one precision vocabulary: the same spellings work (or
are refused with the same message) on all three, and compare emulates each float8 recipe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise
from castwise import Policy
from castwise.errors import AuditError, PolicyError
from castwise.float8.emulate import cast_through
from castwise.numerics._compare_target import parse_target
from castwise.numerics.forecast import target_format
from castwise.policy.float8 import Float8Recipe
from tests.test_policy_vocab import BARE_DTYPE_NAMES, ISSUE_STRINGS

# compare's and forecast's own float8 spellings, before the vocabulary was shared
FLOAT8_NAMES = ["float8_e4m3fn", "e4m3", "fp8_e4m3", "e4m3fn", "f8e4m3fn", "float8_e5m2", "e5m2", "fp8_e5m2"]


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16))
    return model, torch.randn(4, 32)


@pytest.mark.parametrize("text", [*ISSUE_STRINGS, *FLOAT8_NAMES], ids=str)
def test_the_three_surfaces_accept_every_string(text: str | int) -> None:
    policy = Policy.parse(text)
    model, x = _model()
    compared = castwise.compare(model, x, policy=text, mode="eval")
    assert Policy.parse(compared.summary["policy"]) == policy
    forecast = castwise.forecast(model, x, target=text, mode="eval")
    low = policy.float8.forward_dtype if policy.float8 is not None else str(policy.compute_dtype)[6:]
    assert forecast.summary["numerics"]["target"] == castwise._dtypes.short(low)


@pytest.mark.parametrize("text", BARE_DTYPE_NAMES)
def test_a_bare_dtype_name_is_refused_alike_by_policy_and_compare(text: str) -> None:
    model, x = _model()
    with pytest.raises(PolicyError) as parsed:
        Policy.parse(text)
    with pytest.raises(PolicyError) as compared:
        castwise.compare(model, x, policy=text, mode="eval")
    assert str(parsed.value) == str(compared.value) and "bare dtype name" in str(parsed.value)
    # forecast asks for a format only, which both readings share: the name is enough there
    assert target_format(text) in ("bfloat16", "float16")


def test_forecast_targets_read_as_their_narrowest_format() -> None:
    assert target_format("fp8") == target_format("mxfp8") == "float8_e4m3fn"
    assert target_format("transformer-engine-float16") == "float8_e4m3fn"
    assert target_format("e5m2") == "float8_e5m2" and target_format("16-mixed") == "float16"
    assert target_format(16) == "float16" and target_format("--bf16") == "bfloat16"
    with pytest.raises(AuditError, match="computes in f32: nothing narrower to forecast"):
        target_format("32-true")
    with pytest.raises(AuditError, match="target='int8' is not valid: unknown precision 'int8'"):
        target_format("int8")


def test_fp8_compares_as_bf16_autocast_plus_float8_linears() -> None:
    target = parse_target("fp8")
    assert target.policy == Policy.parse("bf16-mixed") and target.float8 == torch.float8_e4m3fn
    assert str(target) == "fp8" and str(target.with_islands(["0"])) == "fp8,keep[0]=f32"
    model, x = _model()
    rows = {r["module"]: r for r in castwise.compare(model, x, policy="fp8", mode="eval").to_dict()["numerics"]}
    assert rows["0"]["dtype"] == "f8e4m3fn" and rows["2"]["dtype"] == "bf16"  # GELU under bf16 autocast


def test_recipes_scale_at_their_granularity() -> None:
    # one outlier in the first row: a per-tensor scale flushes the other rows' small values,
    # per-row and per-block scales keep them
    x = torch.full((2, 64), 1e-3)
    x[0, 0] = 1e4
    tensorwise = cast_through(x, Float8Recipe("tensorwise"))
    rowwise = cast_through(x, Float8Recipe("rowwise"))
    mx = cast_through(x, Float8Recipe("mxfp8"))
    assert tensorwise[1].abs().max() == 0
    assert torch.allclose(rowwise[1], x[1], rtol=2**-3) and rowwise[0, 1] == 0
    # MX: blocks of 32 along the last dim, so the first row's second block keeps its values too
    assert torch.allclose(mx[0, 32:], x[0, 32:], rtol=2**-3) and torch.allclose(mx[1], x[1], rtol=2**-3)
    assert mx[0, 1] == 0 and abs(float(mx[0, 0]) - 1e4) / 1e4 < 2**-3
