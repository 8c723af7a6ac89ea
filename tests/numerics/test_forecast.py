"""forecast: overflow origins and flush-to-zero shares from one wider run, checked against what a
real run in the target dtype does."""

from __future__ import annotations

import copy

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
    report = forecast(model, torch.randn(16, 32), target="float8_e4m3fn")
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


class _Scaled(nn.Module):
    """A Linear whose output is multiplied past float16's range (a planted value fault)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.inner, self.factor = nn.Linear(16, 16), factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.factor


class _FunctionalRMSNorm(nn.Module):
    """A user's norm calling torch's rms_norm: its kernel squares in float32 (on CPU the
    composite runs as pow, mean, rsqrt in the trace)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x, (x.shape[-1],))


class _HandRMSNorm(nn.Module):
    """The same norm written by hand: in float16 its square overflows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _sites(report: object, phase: str = "forward") -> set[str]:
    return {f.module for f in report.findings if f.code == "CW310" and dict(f.details)["phase"] == phase}  # type: ignore[attr-defined]


def test_every_site_is_named_not_only_the_first() -> None:
    # two faults, one after the other: the second's input is past the range in an f16 run (so a
    # real run shows only the first); fixed upstream, it overflows on its own
    torch.manual_seed(0)
    model = nn.Sequential(_Scaled(2e5), nn.LayerNorm(16), nn.Linear(16, 16), _Scaled(2e5), nn.LayerNorm(16))
    report = forecast(model, (torch.randn(4, 16),), target="f16", mode="eval")
    assert _sites(report) == {"0", "3"}
    # the LayerNorm fed the first fault's output (torch's kernel accumulates in float32) is none
    assert "1" not in _sites(report)


def test_a_parameter_past_the_range_is_a_site() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    with torch.no_grad():
        model[2].weight.mul_(1e6)
    report = forecast(model, (torch.randn(4, 16),), target="f16")
    found = [f for f in report.findings if f.code == "CW310" and f.module == "2"]
    assert found and "2.weight" in found[0].message and dict(found[0].details)["phase"] == "forward"
    # locate agrees: a float16 copy of the weight is Inf before any op runs
    assert locate_nonfinite(model.half(), (torch.randn(4, 16).half(),)).findings[0].code == "CW303"


def test_norms_are_judged_by_how_their_kernel_computes() -> None:
    for norm, site in ((_FunctionalRMSNorm, False), (_HandRMSNorm, True)):
        torch.manual_seed(0)
        model = nn.Sequential(_Scaled(300.0), norm(), nn.Linear(16, 16))
        x = torch.randn(4, 16)
        report = forecast(model, (x,), target="f16", mode="eval")
        assert ("1" in _sites(report)) is site, norm
        # a real float16 run: only the hand-written square makes Inf
        made = locate_nonfinite(model.half(), (x.half(),), mode="eval").findings
        assert bool(made and made[0].module == "1") is site, norm


def test_float8_scores_every_gemm_operand_per_recipe_and_the_token_dim() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight[0, 0] = 1e5  # one outlier: per tensor every weight flushes but it
    report = forecast(model, torch.randn(10, 64), target="float8_e4m3fn")
    layer = report.summary["float8"]["layers"]["0"]
    assert set(layer["operands"]) == {"input", "weight", "grad_output"}
    w = layer["operands"]["weight"]
    # per tensor most weights flush; per row only the outlier's row; per 32-block only its block
    assert w["tensorwise"] > 0.9 > 1 / 64 >= w["rowwise"] > w["mxfp8"] >= 0
    assert w["range_pow2"] > 20  # 1e5 against weights around 1e-3
    # 10 tokens: the weight gradient's reduction dim is not a multiple of 16
    assert layer["tokens"] == 10 and "2" in report.summary["float8"]["leave_out"]
    assert any("10 tokens" in f.message for f in report.findings if f.code == "CW313" and f.module == "2")


class _UpcastRMSNorm(nn.Module):
    """A user's RMSNorm as transformers and diffusers write theirs: the square in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class _SumNorm(nn.Module):
    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.abs().sum((-2, -1), keepdim=True, dtype=self.dtype)  # float32: accumulated and returned wide
        return (x / (total + 1.0)).to(x.dtype)


class _Scores(nn.Module):
    def __init__(self, upcast: bool) -> None:
        super().__init__()
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if self.upcast else x  # diffusers' upcast_attention
        scores = h @ h.transpose(-1, -2)
        return (torch.softmax(scores.float(), -1).to(h.dtype) @ h).to(x.dtype)


def test_reductions_and_norms_are_judged_by_the_dtype_the_model_computes_them_in() -> None:
    # the same magnitudes into look-alike ops: only those a real float16 run computes in float16
    # make Inf (the model's own upcasts, a dtype=float32 sum and torch's kernels do not)
    for op, site in (
        (_HandRMSNorm(), True),
        (_UpcastRMSNorm(), False),
        (_SumNorm(None), True),
        (_SumNorm(torch.float32), False),
        (_Scores(upcast=False), True),
        (_Scores(upcast=True), False),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), _Scaled(3000.0), op, nn.Linear(16, 4))
        x = torch.randn(2, 8, 16)
        report = forecast(model, (x,), target="f16", mode="eval", verify=False)
        assert ("2" in _sites(report)) is site, op
        made = locate_nonfinite(copy.deepcopy(model).half(), (x.half(),), mode="eval").findings
        assert bool(made and made[0].module == "2") is site, op


def test_forecast_leaves_a_float32_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _UpcastRMSNorm(), nn.BatchNorm1d(16), nn.Linear(16, 4))
    before = {k: (v.dtype, v.clone(), v.data_ptr()) for k, v in model.state_dict().items()}
    forecast(model, (torch.randn(4, 16),), target="f16")
    after = model.state_dict()
    for k, (dtype, value, ptr) in before.items():
        assert after[k].dtype == dtype and after[k].data_ptr() == ptr and torch.equal(after[k], value), k
    assert all(p.grad is None for p in model.parameters())


class _Float32Only(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"expected float32, got {x.dtype}")
        return x


def test_a_model_that_refuses_float64_is_forecast_from_its_own_run() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Float32Only(), nn.Linear(16, 16), _Scaled(2e5), nn.LayerNorm(16))
    report = forecast(model, (torch.randn(4, 16),), target="f16", mode="eval", verify=False)
    assert _sites(report) == {"2"} and "error" not in report.summary["numerics"]


def test_forecast_verifies_the_islands_it_suggests() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    model = nn.Sequential(nn.Linear(16, 16), _Scaled(2e5), nn.LayerNorm(16), nn.Linear(16, 4))
    (found,) = [f for f in forecast(model, (x,), target="f16").findings if f.code == "CW310"]
    assert "Verified: a real 16-true run with `keep[1]=f32` ends finite" in str(found.fix)
    assert dict(found.details)["verified_islands"] == ["1"]
    # the island's output saturates at 65504 and the next op doubles it: a real run still makes Inf
    # there, which a float32 run cannot show (its input is past the range already)
    model = nn.Sequential(nn.Linear(16, 16), _Scaled(2e5), _Scaled(2.0), nn.LayerNorm(16))
    (found,) = [f for f in forecast(model, (x,), target="f16").findings if f.code == "CW310"]
    assert "Not verified alone" in str(found.fix) and "`keep[1]=f32,keep[2]=f32`" in str(found.fix)
    assert dict(found.details)["verified_islands"] == ["1", "2"]
