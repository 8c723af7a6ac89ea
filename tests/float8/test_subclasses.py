"""Float8 in the field (issue 39): torchtitan-style ``class Linear(nn.Linear)`` layers under the
fp8, rowwise and mxfp8 recipes, audited for cpu, cuda (H100) and cuda:a100. The truth is torchao
on this CPU (emulated GEMMs): what its ``convert_to_float8_training`` and MX ``quantize_`` convert,
and what a converted layer computes."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear

import castwise
from castwise.float8.convert import mx_training


class Linear(nn.Linear):
    """torchtitan's: nn.Linear's forward, its own weight init."""

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.weight, std=std)


class Doubled(nn.Linear):
    """A subclass with its own math in forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * 2.0


class FeedForward(nn.Module):
    """torchtitan's FeedForward (bias-free, as torchtitan's are), w2 with its own forward."""

    def __init__(self, dim: int = 64, hidden: int = 128, down: type[nn.Linear] = Doubled) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)
        self.w2 = down(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class AllOwnMath(nn.Module):
    """Every Linear overrides forward: the fp8 recipes convert nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.up = Doubled(64, 128, bias=False)
        self.down = Doubled(128, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _ffn(down: type[nn.Linear] = Doubled) -> FeedForward:
    torch.manual_seed(0)
    return FeedForward(down=down)


def _config(recipe: str) -> Float8LinearConfig:
    """torchao's own config for the recipe, emulated (this CPU has no float8 GEMMs)."""
    base = Float8LinearConfig.from_recipe_name(recipe) if recipe == "rowwise" else Float8LinearConfig()
    return dataclasses.replace(base, emulate=True)


def _off(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error (float8's is a few percent; a lost x2 is 50% or 100%)."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm())


X = torch.randn(4, 8, 64)  # 32 tokens: a multiple of MX's block too


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_converts_subclasses_and_castwise_converts_those_with_linears_forward(recipe: str) -> None:
    truth = _ffn()
    config = _config(recipe)
    convert_to_float8_training(truth, config=config)
    assert {n for n, m in truth.named_modules() if type(m) is Float8Linear} == {"w1", "w2", "w3"}

    model = _ffn()
    applied = castwise.apply(model, f"fp8,fp8={recipe}")
    f8 = applied.float8
    assert f8 is not None and set(f8.converted) == {"w1", "w3"}
    assert type(model.w1) is Float8Linear and type(model.w3) is Float8Linear and type(model.w2) is Doubled
    assert dict(f8.left_out) == {"w2": "a Doubled that overrides forward: torchao's Float8Linear would replace it"}
    assert "w2  left out: a Doubled that overrides forward" in f8.table()
    model(X).sum().backward()
    applied.remove()
    assert type(model.w1) is Linear and type(model.w2) is Doubled


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchaos_float8linear_drops_an_overridden_forward(recipe: str) -> None:
    """Why the leave-out: torchao's converted w2 computes nn.Linear's math, not Doubled's."""
    model = _ffn()
    h = torch.randn(32, 128)
    own = model.w2(h)
    convert_to_float8_training(model, config=_config(recipe))
    converted = model.w2(h)
    plain = F.linear(h, model.w2.weight)
    assert _off(converted, plain) < 0.1  # nn.Linear's math, float8's rounding aside
    assert _off(converted, own) > 0.4  # the x2 is gone


class MatmulLinear(nn.Linear):
    """transformers' FalconLinear: nn.Linear's math, written as a matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def test_torchaos_mx_weight_runs_in_mx_only_through_f_linear() -> None:
    """torchao's MX quantize_ converts every subclass (it swaps the weight, the module stays), but
    only a forward calling F.linear gets an MX GEMM: ``x @ w.T`` runs unrounded. castwise cannot
    tell which forward a subclass has, so it leaves both out, saying why; nn.Linear's forward converts."""
    truth = _ffn(down=MatmulLinear)
    h = torch.randn(32, 128)
    own = truth.w2(h)
    x = torch.randn(32, 64)
    plain = truth.w1(x)
    mx_training(truth, True, lambda m, _: isinstance(m, nn.Linear))
    assert all(type(m.weight).__name__.startswith("MXFP8") for m in (truth.w1, truth.w2, truth.w3))
    assert 0 < _off(truth.w1(x), plain) < 0.1  # F.linear: MX rounding
    assert _off(truth.w2(h), own) == 0  # `x @ w.T`: no MX GEMM ran

    for down in (MatmulLinear, Doubled):
        model = _ffn(down=down)
        applied = castwise.apply(model, "mxfp8")
        f8 = applied.float8
        assert f8 is not None and set(f8.converted) == {"w1", "w3"}
        assert dict(f8.left_out)["w2"].startswith(f"a {down.__name__} that overrides forward: torchao's MX weight")
        assert type(model.w2.weight) is nn.Parameter and type(model.w1.weight).__name__.startswith("MXFP8")
        model(X).float().sum().backward()
        applied.remove()
        assert type(model.w1.weight) is nn.Parameter


def test_multihead_attentions_out_proj_is_left_out() -> None:
    """nn.MultiheadAttention multiplies by out_proj.weight itself: a Float8Linear there never runs."""
    attn = nn.Sequential(nn.MultiheadAttention(64, 4, batch_first=True))
    for policy in ("fp8", "mxfp8"):
        with pytest.warns(UserWarning, match="converts no Linear"):
            applied = castwise.apply(attn, policy)
        assert applied.float8 is not None
        assert dict(applied.float8.left_out)["0.out_proj"].startswith("nn.MultiheadAttention's out_proj")
        applied.remove()


def test_apply_says_when_a_float8_recipe_converts_nothing() -> None:
    model = AllOwnMath()
    with pytest.warns(UserWarning, match=r"fp8=tensorwise converts no Linear; each is left out") as got:
        applied = castwise.apply(model, "fp8")
    text = str(got[0].message)
    assert "up    left out: a Doubled that overrides forward" in text and "down  left out: a Doubled" in text
    assert applied.float8 is not None and applied.float8.converted == ()
    applied.remove()
    with pytest.warns(UserWarning, match="converts no Linear; the model has no nn.Linear"):
        castwise.apply(nn.Sequential(nn.Conv1d(4, 4, 3)), "fp8").remove()


def test_plain_and_convertible_models_apply_without_a_warning() -> None:
    for model in (nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)), _ffn(down=Linear)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            applied = castwise.apply(model, "fp8")
        assert applied.float8 is not None and len(applied.float8.converted) == 3 - isinstance(model, nn.Sequential)
        applied.remove()


def _audit(model: nn.Module, policy: str, device: str) -> castwise.Report:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # apply's "converts no Linear", said above
        return castwise.audit(model, X, policy=policy, device=device, mode="train")


@pytest.mark.parametrize("policy", ["fp8", "fp8,fp8=rowwise", "mxfp8"])
def test_a_gpu_without_the_format_is_an_error_though_nothing_converted(policy: str) -> None:
    report = _audit(AllOwnMath(), policy, "cuda:a100")
    assert [f.code for f in report.errors] == ["CW132"]
    f = report.errors[0]
    recipe = castwise.Policy.parse(policy).float8
    assert f"fp8={recipe}" in f.message and "cuda:a100 (compute capability 8.0) cannot run it" in f.message
    assert f.fix is not None and "bf16-mixed" in f.fix
    assert dict(f.details)["recipe"] == str(recipe) and dict(f.details)["gpu_has_fp8"] is False


def test_mx_on_hopper_names_the_recipe_hopper_has() -> None:
    report = _audit(AllOwnMath(), "mxfp8", "cuda")
    codes = [f.code for f in report.errors]
    assert codes == ["CW132"]
    f = report.errors[0]
    assert "MX block-scaled" in f.message and f.fix is not None and "tensorwise or rowwise" in f.fix
    assert dict(f.details)["fp8_kernel"] == "mx" and dict(f.details)["gpu_has_fp8"] is True


def test_two_e5m2_operands_are_an_error_on_any_gpu() -> None:
    report = _audit(AllOwnMath(), "fp8,fp8=tensorwise:e5m2", "cuda")
    assert [(f.code, dict(f.details)["fp8_kernel"]) for f in report.errors] == [("CW132", "e5m2")]


def test_converted_subclasses_reach_the_gemm_check() -> None:
    """torchtitan's Linear converts: its float8 GEMM itself is refused on an A100, once."""
    report = _audit(_ffn(), "fp8", "cuda:a100")
    cw132 = [f for f in report.errors if f.code == "CW132"]
    assert len(cw132) == 1 and cw132[0].module in {"w1", "w3"} and "float8 GEMM" in cw132[0].message


@pytest.mark.parametrize(
    ("policy", "device"),
    [
        ("fp8", "cpu"),
        ("fp8", "cuda"),
        ("fp8,fp8=rowwise", "cpu"),
        ("fp8,fp8=rowwise", "cuda"),
        ("mxfp8", "cpu"),
        ("mxfp8", "cuda:b200"),
    ],
)
def test_gpus_and_cpus_that_run_the_format_are_clean(policy: str, device: str) -> None:
    for model in (AllOwnMath(), _ffn()):
        assert _audit(model, policy, device).ok


def test_bf16_on_an_a100_is_clean() -> None:
    for model in (AllOwnMath(), _ffn()):
        assert _audit(model, "bf16-mixed", "cuda:a100").ok


def test_a_plain_model_is_still_reported_per_gemm_not_twice() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    report = _audit(model, "fp8", "cuda:a100")
    assert [(f.code, f.module) for f in report.errors] == [("CW132", "0")]


def test_the_audit_leaves_the_users_model_as_it_was() -> None:
    model = _ffn()
    before = copy.deepcopy(model.state_dict())
    _audit(model, "fp8", "cuda:a100")
    assert type(model.w1) is Linear and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
