"""The float8 leave-out list judged by the recipe a target trains with (CW313)."""

from __future__ import annotations

import torch
from torch import nn

from castwise.float8 import score as f8s
from castwise.numerics.forecast import forecast

E4M3 = ("float8_e4m3fn", -10.0)  # the format, log2 of half its smallest subnormal


def _outlier_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[2].weight[0, 0] = 1e7  # per tensor every other weight flushes; per row only row 0's
    return model


def test_the_recipe_named_by_the_target_judges_the_leave_out_list() -> None:
    model = _outlier_model()
    x = torch.randn(32, 64)
    tensorwise = forecast(model, x, target="fp8").summary["float8"]
    rowwise = forecast(model, x, target="bf16-mixed,fp8=rowwise").summary["float8"]
    mx = forecast(model, x, target="mxfp8").summary["float8"]
    assert (tensorwise["recipe"], rowwise["recipe"], mx["recipe"]) == ("tensorwise", "rowwise", "mxfp8")
    # per tensor the outlier takes every weight row and column with it, and layer 0's grad_output
    # (its column 0 scaled by the outlier) every other column; per row or per 32-block only its
    # own row and block lose values, and no output or gradient feature is lost
    assert tensorwise["leave_out"] == ["0", "2"]
    assert rowwise["leave_out"] == [] and mx["leave_out"] == []
    assert tensorwise["layers"]["2"]["lost_share"]["weight"] > 0.9
    assert "2" not in rowwise["module_filter_fn"] and "'2'" in tensorwise["module_filter_fn"]


def test_mxfp8_judges_every_gemm_by_its_32_block_and_its_bias() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, bias=False), nn.ReLU(), nn.Linear(48, 64))
    x = torch.randn(32, 64)
    f8 = forecast(model, x, target="fp8").summary["float8"]
    mx = forecast(model, x, target="mxfp8").summary["float8"]
    assert f8["leave_out"] == []  # 48 and 64 are multiples of 16: _scaled_mm takes them
    assert mx["leave_out"] == ["0", "2"]
    gemms = mx["layers"]["0"]["gemms"]
    assert gemms["forward"] != "ok" and "32" in gemms["forward"]
    assert any("bias" in r for r in mx["layers"]["2"]["reasons"])  # torchao's MX linear drops it


def test_the_weight_gradient_gemm_reduces_over_the_tokens_with_the_kernels_own_message() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    report = forecast(model, torch.randn(24, 64), target="bf16-mixed,fp8=rowwise")
    layer = report.summary["float8"]["layers"]["0"]
    assert layer["gemms"]["forward"] == "ok" and layer["gemms"]["grad_input"] == "ok"
    assert "divisible by 16" in layer["gemms"]["grad_weight"]  # _scaled_mm's contract, word for word
    # eval runs no backward: the token count does not matter
    evaluated = forecast(model, torch.randn(24, 64), target="bf16-mixed,fp8=rowwise", mode="eval")
    assert evaluated.summary["float8"]["leave_out"] == []


def test_lost_features_count_lines_not_values() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    w[:, 3] *= 1e-9  # one input feature's weights: 1/64 of the values, all of column 3
    got = f8s.shares(f8s.scores(w, *E4M3))
    assert got["lost_cols_tensorwise"] == 1 / 64 and got["lost_rows_tensorwise"] == 0
    assert got["lost_cols_rowwise"] == 0  # scaled along the column (grad_input's reduction), it is kept


def test_an_operand_under_torchaos_amax_floor_is_lost_per_tensor() -> None:
    # torchao scales by max / max(amax, 1e-12): a grad_output of 1e-19 lands at 2^-14, far under
    # e4m3's range; MX's power-of-two block scales reach 2^-127
    g = torch.randn(32, 64) * 1e-19
    got = f8s.shares(f8s.scores(g, *E4M3))
    assert got["lost_cols_tensorwise"] == 1.0 and got["lost_cols_mxfp8"] == 0.0


def test_rowwise_sees_a_row_scaled_value_lost_against_the_weights_large_column() -> None:
    # input feature 0 is 10^-7 of its row's largest: each row's own scale flushes it (one column
    # of 64, no operand loses 5% of its lines); the weight's column 0 is 10^8 x the rest, so
    # that flushed term was every output feature. Only both operands together show it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[0].weight[:, 0] *= 1e8
    x = torch.randn(32, 64)
    x[:, 0] = 1e-7 * x.abs().amax(dim=1)
    layer = forecast(model, x, target="bf16-mixed,fp8=rowwise").summary["float8"]["layers"]["0"]
    assert max(layer["lost_share"].values()) < 0.05  # per operand: nothing to see
    assert layer["leave_out"]
    assert layer["gemm_lost_share"]["forward"] == 1.0
    assert any("forward GEMM" in r for r in layer["reasons"])


def test_mxfp8_sees_one_outlier_flush_its_blocks_neighbours() -> None:
    # input feature 0 is 10^6: each token's first MX block of 32 is scaled to it and its 31
    # neighbours (about 1) flush, half the terms of every output feature; per row or per block,
    # no line of either operand is lost on its own
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[0].weight[:, 0] = 1e-6 * model[0].weight[:, 0].sign()  # the outlier's own term: about 1
    x = torch.randn(32, 64)
    x[:, 0] = 1e6
    mx = forecast(model, x, target="mxfp8").summary["float8"]["layers"]["0"]
    assert max(mx["lost_share"].values()) < 0.05
    assert mx["leave_out"]
    assert mx["gemm_lost_share"]["forward"] > 0.9
    # the weight gradient's GEMM reduces over the tokens: there feature 0 is a block of its own
    assert mx["gemm_lost_share"]["grad_weight"] == 0.0
