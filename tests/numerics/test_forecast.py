"""forecast: overflow origins and flush-to-zero shares from one wider run, checked against what a
real run in the target dtype does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from castwise.errors import CastwiseError
from castwise.numerics.forecast import forecast
from castwise.numerics.locate import locate_nonfinite
from tests.numerics import cases

WO = "encoder.block.0.layer.1.DenseReluDense.wo"


def test_t5_wo_overflow_forecast_from_float32_matches_the_fp16_run() -> None:
    model, inputs = cases.t5_encoder()
    report = forecast(model, inputs, target="f16")
    overflow = [f for f in report.findings if f.code == "CW310"]
    assert [f.module for f in overflow] == [WO]
    details = dict(overflow[0].details)
    assert 0 < details["margin_pow2"] < 1 and details["phase"] == "forward"
    # the real fp16 run overflows exactly there
    assert locate_nonfinite(model.half(), inputs).findings[0].module == WO


def test_bf16_target_does_not_overflow_where_f16_does() -> None:
    model, inputs = cases.t5_encoder()
    assert not [f for f in forecast(model, inputs, target="bf16").findings if f.code == "CW310"]


def test_inherited_overflow_is_not_an_origin() -> None:
    # the scores overflow; the softmax and the value product downstream only inherit it
    model, (x,) = cases.attention_scores_overflow()
    report = forecast(model.float(), (x.float(),), target="f16", mode="eval")
    assert [(f.module, f.op) for f in report.findings if f.code == "CW310"] == [("attn", "aten.bmm")]
    stats = report.to_dict()["summary"]["numerics"]["modules"]["attn"]["forward"]
    assert stats["absmax"] > 65504 and stats["overflow_ops"] == 1


def test_backward_overflow_inside_a_norm_is_the_norms_not_the_top_levels() -> None:
    # the norm's intermediates are float32 in an fp16 run, but the gradient it passes on is fp16
    model, inputs = cases.norm_backward_overflow()
    report = forecast(model, inputs, target="f16")
    sites = [(f.module, dict(f.details)["phase"]) for f in report.findings if f.code == "CW310"]
    assert sites == [("1", "backward")]
    real = locate_nonfinite(model.half(), (inputs[0].half(),)).findings[0]
    assert (real.module, dict(real.details)["phase"]) == ("1", "backward")


def test_gradient_underflow_without_loss_scaling() -> None:
    model, inputs = cases.small_gradients()
    report = forecast(model, inputs, target="f16")
    grads = {f.module: dict(f.details) for f in report.findings if f.code == "CW312"}
    assert "body" in grads and grads["body"]["flush_share"] > 0.5
    k = grads["body"]["loss_scale_pow2"]
    assert 1 <= k <= 24
    # a real fp16 backward: those gradients are zeros; with the suggested loss scale they are not
    half = model.half()
    half(inputs[0].half()).float().sum().backward()
    zero_share = float((half.body.weight.grad == 0).float().mean())
    half.zero_grad()
    (half(inputs[0].half()).float().sum() * 2.0**k).backward()
    scaled_zero_share = float((half.body.weight.grad == 0).float().mean())
    assert zero_share > 0.5 and scaled_zero_share < 0.1


def test_float8_names_layers_to_leave_out_with_a_policy_and_a_filter() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():
        model[2].weight[0, 0] = 1e4  # one outlier: after scaling by absmax every other weight flushes
    report = forecast(model, torch.randn(4, 32), target="float8_e4m3fn")
    f8 = report.summary["float8"]
    assert f8["leave_out"] == ["2", "4"]  # 2: the outlier; 4: 10 outputs, not a multiple of 16
    assert f8["policy"] == "keep[2]=bf16,keep[4]=bf16"
    namespace: dict[str, object] = {"torch": torch}
    exec(f8["module_filter_fn"], namespace)
    keep = namespace["module_filter_fn"]
    assert callable(keep)
    assert [keep(m, n) for n, m in model.named_modules() if isinstance(m, nn.Linear)] == [True, False, False]
    assert {f.module for f in report.findings if f.code == "CW313"} == {"2", "4"}
    from castwise.policy import Policy

    assert str(Policy.parse("bf16-mixed," + f8["policy"])) == "bf16-mixed," + f8["policy"]


def test_mask_values_at_the_dtype_limit_are_not_overflow() -> None:
    model, (x, mask) = cases.softmax_all_masked_row()
    mask[1, 2, 0] = False
    model.attn.forward = lambda x, mask=None: cases.Attention.forward(  # type: ignore[method-assign]
        model.attn, x, mask, torch.finfo(torch.float32).min
    )
    report = forecast(model, (x, mask), target="f16")
    assert not [f for f in report.findings if f.code == "CW310"]


def test_bad_target_lists_the_valid_ones() -> None:
    with pytest.raises(CastwiseError, match=r"valid: .*bf16.*f16"):
        forecast(nn.Linear(2, 2), torch.randn(1, 2), target="int8")
