"""The policy's reduce dtype: ``reduce=DT`` parses, prints back, defaults to f32."""

from __future__ import annotations

import pytest
import torch

from castwise import Policy, PolicyError


def test_reduce_defaults_to_f32_for_every_preset() -> None:
    # but Megatron's --fp16, which reduces in float16 unless --accumulate-allreduce-grads-in-fp32
    presets = Policy.presets()
    assert all(p.reduce_dtype == torch.float32 for name, p in presets.items() if name != "--fp16")
    assert presets["--fp16"].reduce_dtype == torch.float16
    assert "reduce" not in str(Policy.parse("bf16-mixed"))


@pytest.mark.parametrize(
    ("text", "dtype", "printed"),
    [
        ("bf16-mixed,reduce=bf16", torch.bfloat16, "bf16-mixed,reduce=bf16"),
        ("bf16-true,reduce=float32", torch.float32, "bf16-true"),
        ("16-mixed,reduce=f16", torch.float16, "16-mixed,reduce=f16"),
    ],
)
def test_reduce_clause_parses_and_round_trips(text: str, dtype: torch.dtype, printed: str) -> None:
    policy = Policy.parse(text)
    assert policy.reduce_dtype == dtype
    assert str(policy) == printed
    assert Policy.parse(str(policy)) == policy


def test_bad_reduce_dtype_names_the_valid_ones() -> None:
    with pytest.raises(PolicyError, match=r"reduce: 'int8' is not a dtype castwise manages; valid: bf16, f16, f32"):
        Policy.parse("bf16-mixed,reduce=int8")
    with pytest.raises(PolicyError, match="reduce_dtype="):
        Policy(reduce_dtype=torch.int8)
