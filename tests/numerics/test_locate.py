"""locate_nonfinite on real cases: the producing module and op, the verdict, the fix, the line."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import castwise
from castwise.errors import CastwiseError
from castwise.numerics.locate import locate_nonfinite
from tests.numerics import cases

CASES: dict[str, tuple[Callable[[], tuple[nn.Module, Any]], str, str, str, str]] = {
    # name: (build, code, module, op, phase)
    "t5_wo_fp16": (
        lambda: _half(cases.t5_encoder()),
        "CW301",
        "encoder.block.0.layer.1.DenseReluDense.wo",
        "aten.mm",
        "forward",
    ),
    "attention_scores_fp16": (cases.attention_scores_overflow, "CW301", "attn", "aten.bmm", "forward"),
    "softmax_all_masked": (cases.softmax_all_masked_row, "CW302", "attn", "aten._softmax", "forward"),
    "log_zero_in_loss": (cases.log_of_zero_in_loss, "CW302", "loss", "aten.log", "forward"),
    "exp_fp16": (lambda: cases.exp_overflow(1.2), "CW301", "rate", "aten.exp", "forward"),
    "exp_f32": (lambda: cases.exp_overflow(10.0), "CW302", "rate", "aten.exp", "forward"),
    "layernorm_variance_fp16": (cases.layernorm_variance_fp16, "CW301", "norm", "aten.div", "forward"),
    "grad_overflow_fp16": (cases.backward_overflow_fp16, "CW301", "1", "aten.mul", "backward"),
    "sqrt_grad_at_zero": (cases.backward_sqrt_at_zero, "CW302", "1", "aten.div", "backward"),
}


def _half(built: tuple[nn.Module, Any]) -> tuple[nn.Module, Any]:
    return built[0].half(), built[1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_names_the_producer_and_the_verdict(name: str) -> None:
    build, code, module, op, phase = CASES[name]
    model, inputs = build()
    report = locate_nonfinite(model, inputs)
    assert len(report.findings) == 1, report
    f = report.findings[0]
    details = dict(f.details)
    assert (f.code, f.module, f.op, details["phase"]) == (code, module, op, phase)
    assert details["verdict"] == ("precision" if code == "CW301" else "bug")
    assert details["inputs"] and all("absmax" in r for r in details["inputs"])
    assert details["limits"]["max"] == torch.finfo(model.parameters().__next__().dtype).max
    assert report.to_dict()["summary"]["numerics"]["modules"][module]["op"] == op
    if phase == "forward" and not name.startswith("t5"):
        assert details["source"].startswith(cases.__file__)  # the user's line, not torch's


def test_t5_overflow_is_a_warning_because_transformers_clamps_it() -> None:
    model, inputs = _half(cases.t5_encoder())
    f = locate_nonfinite(model, inputs).findings[0]
    assert f.level == "warning" and dict(f.details)["reaches_output"] is False
    assert "keep[encoder.block.0.layer.1.DenseReluDense.wo]=f32" in (f.fix or "")
    # the fix follows the verdict: keep wo in float32 and nothing overflows
    from castwise.numerics.locate import locate_nonfinite as again

    model.encoder.block[0].layer[1].DenseReluDense.wo.float()

    class CastBack(nn.Module):  # what castwise's keep[...]=f32 island does around the module
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x.float()).clamp(-65504, 65504).half()

    model.encoder.block[0].layer[1].DenseReluDense.wo = CastBack(model.encoder.block[0].layer[1].DenseReluDense.wo)
    assert not any(f.code == "CW301" for f in again(model, inputs).findings)


def test_real_bug_fix_names_the_change() -> None:
    model, inputs = cases.log_of_zero_in_loss()
    f = locate_nonfinite(model, inputs).findings[0]
    assert "clamp_min(eps)" in (f.fix or "") and "A wider dtype does not help" in (f.fix or "")
    model, inputs = cases.softmax_all_masked_row()
    assert "finfo(dtype).min" in (locate_nonfinite(model, inputs).findings[0].fix or "")


def test_a_minus_inf_mask_value_is_not_a_producer() -> None:
    model, (x, mask) = cases.softmax_all_masked_row()
    mask[1, 2, 0] = False  # every query can attend somewhere: -inf fills, no NaN anywhere
    assert locate_nonfinite(model, (x, mask)).findings == []


def test_finite_model_has_no_finding_and_counts_ops() -> None:
    model, inputs = cases.attention_scores_overflow()
    report = locate_nonfinite(model.float(), (inputs[0].float(),))
    assert report.findings == [] and report.ok
    assert report.summary["numerics"]["ops_checked"] > 10


def test_nonfinite_weights_are_reported_as_state_not_as_an_op() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    f = locate_nonfinite(model, torch.randn(2, 4)).findings[0]
    assert f.code == "CW303" and dict(f.details)["tensors"] == ["parameter 1.weight"]


def test_eval_mode_checks_forward_only() -> None:
    model, inputs = cases.backward_sqrt_at_zero()
    assert locate_nonfinite(model, inputs, mode="eval").findings == []
    assert locate_nonfinite(model, inputs, mode="train").findings[0].code == "CW302"


def test_model_grads_buffers_modes_and_rng_are_left_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))
    model(torch.randn(8, 4)).sum().backward()
    model.eval()
    before = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    locate_nonfinite(model, x)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    assert torch.equal(rng, torch.get_rng_state())


def test_policy_runs_on_a_copy_under_the_policy() -> None:
    model, inputs = cases.exp_overflow(1.2)
    model, inputs = model.float(), (inputs[0].float(),)
    report = locate_nonfinite(model, inputs, policy="16-true")
    assert report.findings[0].code == "CW301" and report.runs[0].policy == "16-true"
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"mode": "both"}, "valid: eval, train"),
        ({"device": "tpu"}, r"valid: cpu, cpu:amx, .*, cuda, cuda:a100"),
        ({"policy": 3}, "policy must be"),
    ],
)
def test_bad_arguments_say_what_is_valid(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(CastwiseError, match=words):
        locate_nonfinite(nn.Linear(2, 2), torch.randn(1, 2), **kwargs)


class _Amp(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class _TwoOverflows(nn.Module):
    """``a`` overflows f16; kept f32 its output saturates to 65504, which ``b`` (k > 1) overflows
    again, and y - y turns the Inf into a NaN loss: one island is not enough."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.a, self.b = _Amp(1000.0), _Amp(k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.a(self.proj(x) * 0 + x))
        return (y - y).sum()


def _real_loss_finite(k: float, policy: str) -> bool:
    model = _TwoOverflows(k)
    castwise.apply(model, policy)
    return bool(torch.isfinite(model(torch.full((2, 4), 100.0))))


def test_an_island_that_leaves_the_loss_nan_is_not_verified_and_the_smallest_set_is_searched() -> None:
    # issue 39: --locate suggested one f32 island that left the loss NaN, unverified and unsaid
    assert not _real_loss_finite(2.0, "16-true,keep[a]=f32")
    assert _real_loss_finite(2.0, "16-true,keep[a]=f32,keep[b]=f32")
    report = castwise.locate_nonfinite(_TwoOverflows(2.0), torch.full((2, 4), 100.0), policy="16-true", mode="eval")
    (f,) = [f for f in report.findings if f.code == "CW301"]
    assert f.module == "a" and "Not verified alone" in (f.fix or "") and "keep[a]=f32,keep[b]=f32" in (f.fix or "")
    assert dict(f.details)["verified_islands"] == ["a", "b"]


def test_an_island_that_makes_the_run_finite_says_verified() -> None:
    assert _real_loss_finite(1.0, "16-true,keep[a]=f32")  # b does not overflow the saturated 65504
    report = castwise.locate_nonfinite(_TwoOverflows(1.0), torch.full((2, 4), 100.0), policy="16-true", mode="eval")
    (f,) = [f for f in report.findings if f.code == "CW301"]
    assert "Verified: re-run with `keep[a]=f32`" in (f.fix or "")
    assert dict(f.details)["verified_islands"] == ["a"]
