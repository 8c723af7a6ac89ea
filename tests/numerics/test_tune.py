"""castwise.tune: the fewest float32 islands under which the error is within the budget."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import castwise
from castwise.errors import CastwiseError
from tests.numerics.plants import Cancel, TinyEpsScale, mlp


def _output_err(model: torch.nn.Module, inputs: tuple[torch.Tensor], policy: object) -> float:
    """The tuned policy checked independently: apply it to a copy, the relative L2 error of its
    output (the mlp returns no loss: tune measures its output)."""
    with torch.no_grad():
        ref_out = model(*inputs)
        twin = copy.deepcopy(model)
        castwise.apply(twin, policy)
        low = twin(*inputs).float()
    return float(torch.linalg.vector_norm(low - ref_out) / torch.linalg.vector_norm(ref_out))


def test_tune_keeps_only_the_planted_module_and_meets_the_budget() -> None:
    model, inputs = mlp(Cancel, where=2)
    tuned = castwise.tune(model, inputs, policy="bf16-mixed", budget=1e-2)
    assert tuned.islands == ("layers.2.0",)
    assert tuned.met and tuned.error <= 1e-2 < tuned.baseline_error
    assert str(tuned.policy) == "bf16-mixed,keep[layers.2.0]=f32"
    assert tuned.metric == "output"
    assert _output_err(model, inputs, tuned.policy) == pytest.approx(tuned.error, rel=1e-3, abs=1e-6)
    n_modules = len(list(model.modules()))
    assert tuned.runs <= 2 + math.log2(n_modules)
    # the island is one Linear of six (16x32, 4 of 32x32, 32x4): 1024 of 4736 multiply-adds
    assert tuned.low_precision_share == pytest.approx(1 - 1024 / 4736, abs=1e-6)
    assert tuned.island_share == pytest.approx(1024 / 4736, abs=1e-6)


def test_tune_finds_the_nonfinite_producer_in_f16() -> None:
    model, inputs = mlp(TinyEpsScale, where=1)
    tuned = castwise.tune(model, inputs, policy="16-true", budget=1e-2)
    assert math.isinf(tuned.baseline_error)
    assert tuned.islands == ("layers.1.0",) and tuned.met


def test_healthy_model_needs_no_island_and_one_run() -> None:
    model, inputs = mlp()
    tuned = castwise.tune(model, inputs, policy="bf16-mixed", budget=1e-2)
    assert tuned.islands == () and tuned.runs == 1 and tuned.low_precision_share == 1.0
    assert str(tuned.policy) == "bf16-mixed"
    assert [f.code for f in tuned.findings] == ["CW331"]


def test_unreachable_budget_is_an_error_finding() -> None:
    model, inputs = mlp()
    tuned = castwise.tune(model, inputs, policy="bf16-true", budget=1e-9)
    assert not tuned.met and not tuned.ok
    assert [f.code for f in tuned.findings] == ["CW330"]
    assert tuned.error > 1e-9
    assert "NOT within the budget" in str(tuned)


def test_float8_target_returns_a_float8_policy_string() -> None:
    model, inputs = mlp()
    tuned = castwise.tune(model, inputs, policy="float8_e4m3fn", budget=4e-2, mode="eval", metric="output")
    assert tuned.baseline_error > 4e-2  # float8 rounding of every Linear is too much for this budget
    assert isinstance(tuned.policy, str) and tuned.policy.startswith("float8_e4m3fn,keep[")
    assert tuned.met and tuned.islands and tuned.error <= 4e-2
    assert all(name in dict(model.named_modules()) for name in tuned.islands)
    assert 0 < tuned.low_precision_share < 1


def test_to_dict_and_str() -> None:
    model, inputs = mlp(Cancel, where=2)
    tuned = castwise.tune(model, inputs, policy="bf16-mixed", budget=1e-2, metric="output")
    data = json.loads(json.dumps(tuned.to_dict()))
    assert data["policy"] == "bf16-mixed,keep[layers.2.0]=f32" and data["metric"] == "output"
    assert data["islands"] == ["layers.2.0"] and data["findings"][0]["code"] == "CW331"
    text = str(tuned)
    assert "float32 islands (1): layers.2.0" in text and "within the budget" in text


def test_the_users_model_is_unchanged() -> None:
    model, inputs = mlp(Cancel, where=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    castwise.tune(model, inputs, policy="16-true", budget=1e-2)
    assert all(torch.equal(before[k], v) and before[k].dtype == v.dtype for k, v in model.state_dict().items())
    assert all("forward" not in m.__dict__ and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budget": 0}, "budget=0 is not valid"),
        ({"budget": "1%"}, "budget='1%' is not valid"),
        ({"budget": 1e-2, "metric": "accuracy"}, "valid: loss, output"),
        ({"budget": 1e-2, "mode": "both"}, "valid: eval, train"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    model, inputs = mlp()
    with pytest.raises(CastwiseError, match=match):
        castwise.tune(model, inputs, policy="bf16-mixed", **kwargs)


def test_t5_under_f16_rediscovers_wo() -> None:
    pytest.importorskip("transformers")
    from castwise.stories import build_t5_overflow

    model, inputs = build_t5_overflow()
    tuned = castwise.tune(model, inputs, policy="16-true,keep_in_fp32=off", budget=1e-2)
    assert tuned.islands == ("encoder.block.2.layer.1.DenseReluDense.wo",)
    assert math.isinf(tuned.baseline_error) and tuned.met
    assert tuned.low_precision_share >= 0.95
    assert tuned.runs <= 2 + math.log2(len(list(model.modules())))
