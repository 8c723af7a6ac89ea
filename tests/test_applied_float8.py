"""castwise.apply with a float8 recipe: torchao's float8 training layers (emulated on CPU),
castwise's leave-out filter, and remove() restoring the model exactly."""

from __future__ import annotations

import pytest
import torch
from benchmarks.bench_fp8_apply import measure, tolerance
from benchmarks.zoo import models as zoo
from torch import nn
from torchao.float8.float8_linear import Float8Linear

import castwise
from castwise.errors import ApplyError
from castwise.float8.convert import leave_out, mx_drops_bias, plan
from castwise.policy.float8 import Float8Recipe


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 24)  # 24: not a multiple of 16
        self.small = nn.Linear(24, 32)
        self.proj = nn.Linear(32, 64)
        self.decode = nn.Linear(64, 64, bias=False)
        self.tied = nn.Linear(32, 64, bias=False)
        self.tied.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.decode(self.proj(self.small(self.odd(self.up(x))))) + self.tied(x)


def test_llama_converts_the_filtered_linears_and_lists_the_rest() -> None:
    model, x = zoo.build("llama")
    applied = castwise.apply(model, "fp8")
    f8 = applied.float8
    assert f8 is not None and f8.recipe == Float8Recipe("tensorwise")
    assert len(f8.converted) == 10 and "model.layers.0.mlp.down_proj" in f8.converted
    why = dict(f8.left_out)
    assert set(why) == {f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "kv"} | {"lm_head"}
    assert why["lm_head"].startswith("the output head")
    assert why["model.layers.0.self_attn.k_proj"].startswith("tiny (32x16")
    assert type(model.get_submodule("model.layers.0.mlp.down_proj")) is Float8Linear
    assert type(model.lm_head) is nn.Linear
    assert "left out: tiny" in f8.table() and "float8 (tensorwise)" in f8.table()
    model(**x).logits.float().sum().backward()
    applied.remove()


def test_remove_restores_classes_parameters_and_values() -> None:
    model, x = zoo.build("qwen2")
    classes = {n: type(m) for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    applied = castwise.apply(model, "fp8")
    model(**x).logits.float().sum().backward()
    applied.remove()
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert all(params[n] is p for n, p in model.named_parameters())
    assert all(torch.equal(values[n], p) for n, p in model.named_parameters())
    assert castwise.applied.applied_to(model) is None
    castwise.apply(model, "fp8").remove()  # applies again after remove


def test_a_step_trained_under_fp8_stays_trained_after_remove() -> None:
    model, x = zoo.build("llama")
    weight = model.get_submodule("model.layers.0.mlp.up_proj").weight
    before = weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = castwise.apply(model, "fp8,fp8=rowwise")
    model(**x).logits.float().pow(2).mean().backward()
    opt.step()
    applied.remove()
    assert model.get_submodule("model.layers.0.mlp.up_proj").weight is weight
    assert not torch.equal(weight.detach(), before)


def test_the_filter_leaves_out_tied_misshaped_tiny_head_and_island_layers() -> None:
    model = Tied()
    applied = castwise.apply(model, "fp8,keep[proj]=bf16")
    f8 = applied.float8
    assert f8 is not None
    why = dict(f8.left_out)
    assert f8.converted == ("up", "decode")
    assert "(64, 24) are not multiples of 16" in why["odd"]
    assert "(24, 32) are not multiples of 16" in why["small"]
    assert why["proj"] == "kept in bfloat16 by the policy's keep[proj] island"
    assert why["tied"] == "its weight is tied to embed's (tied embeddings)"
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    applied.remove()
    assert all(type(m) is nn.Linear for m in (model.up, model.decode))


def test_tiny_root_and_mx_multiples() -> None:
    mx = Float8Recipe("mxfp8")
    assert leave_out("x", nn.Linear(48, 48), mx) is not None  # 48: a multiple of 16, not of 32
    assert leave_out("x", nn.Linear(48, 48), Float8Recipe()) is None
    assert "tiny (16x16" in str(leave_out("x", nn.Linear(16, 16), Float8Recipe()))
    assert plan(nn.Linear(64, 64), Float8Recipe(), {}).converted == ()


def test_mxfp8_trains_emulated_and_restores_parameter_objects() -> None:
    model, _ = zoo.build("llama")
    params = dict(model.named_parameters())
    applied = castwise.apply(model, "mxfp8")
    assert applied.float8 is not None and len(applied.float8.converted) == 10
    ids = zoo.ids(16)  # 32 tokens: MX blocks of 32 along the token dim in the weight gradient
    model(input_ids=ids, labels=ids).loss.backward()
    applied.remove()
    assert all(params[n] is p and type(p.data) is torch.Tensor for n, p in model.named_parameters())
    assert all("forward" not in vars(m) for m in model.modules())


def test_mxfp8_never_loses_a_linears_bias() -> None:
    # torchao 0.18's MX training linear computes x @ w alone: castwise measures what the installed
    # torchao does and keeps a biased Linear out of MX where it drops the bias
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[0].bias.fill_(100.0)
    x = torch.randn(32, 64)
    before = model(x).detach()
    applied = castwise.apply(model, "mxfp8")
    assert applied.float8 is not None and "2" in applied.float8.converted  # no bias: MX as before
    after = model(x).detach()
    applied.remove()
    # float8 rounding (a few percent), not a lost bias of 100 (about 100% of the output)
    assert float((after - before).norm() / before.norm()) < 0.1
    biased = dict(applied.float8.left_out).get("0")
    assert (biased is not None) == mx_drops_bias()
    assert biased is None or "drops" in biased


def test_recipes_torchao_does_not_train_are_refused_before_any_change() -> None:
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ApplyError, match="apply cannot run fp8=delayed yet"):
        castwise.apply(model, "bf16-mixed,fp8=delayed")
    with pytest.raises(ApplyError, match="torchao's rowwise recipe is e4m3 only"):
        castwise.apply(model, "bf16-mixed,fp8=rowwise:hybrid")
    assert type(model[0]) is nn.Linear and castwise.applied.applied_to(model) is None


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "opt", "phi"])
def test_fp8_trains_within_compares_tolerance_of_bf16(name: str) -> None:
    row = measure(name, "fp8", steps=2)
    assert row.converted and row.restored
    assert row.max_rel <= tolerance("fp8")
    assert row.losses_fp8 != row.losses_ref  # float8 rounding did run


def test_the_forecasts_leave_out_list_is_what_apply_leaves_out() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    with torch.no_grad():
        model[1].weight[3, 3] = 1e5  # an outlier: scaled by it, the rest of the layer flushes (CW313)
    f8 = castwise.forecast(model, (torch.randn(4, 32),), target="fp8").summary["float8"]
    assert "1" in f8["leave_out"]
    applied = castwise.apply(model, "fp8," + f8["policy"])
    assert applied.float8 is not None
    assert set(dict(applied.float8.left_out)) == set(f8["leave_out"])
    assert applied.float8.converted == tuple(n for n in ("0", "1", "2") if n not in f8["leave_out"])
    applied.remove()


def test_the_forecast_and_apply_read_one_filter() -> None:
    # the odd, small and tied layers: apply leaves them out, and the forecast's list says so with
    # the same reason (the head by name is the same filter too), before any number is judged
    torch.manual_seed(0)
    model = Tied()
    ids = torch.randint(0, 64, (4, 16))
    f8 = castwise.forecast(model, (ids,), target="fp8").summary["float8"]
    applied = castwise.apply(model, "fp8")
    assert applied.float8 is not None
    left = dict(applied.float8.left_out)
    applied.remove()
    assert set(left) == {"odd", "small", "tied"} and set(left) <= set(f8["leave_out"])
    for name, why in left.items():
        assert f8["layers"][name]["reasons"][0] == why
