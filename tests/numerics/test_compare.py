"""castwise.compare: per-module error against a reference, added vs inherited, on real tensors."""

from __future__ import annotations

import json
import math

import pytest
import torch

import castwise
from castwise.errors import CastwiseError, PolicyError
from tests.numerics.plants import Cancel, TinyEpsScale, encoder, mlp


def _rows(report: castwise.Report) -> dict[str, dict]:
    return {row["module"]: row for row in report.to_dict()["numerics"]}


@pytest.mark.parametrize("build", [mlp, encoder], ids=["mlp", "encoder"])
def test_healthy_model_under_bf16_mixed_flags_nothing(build) -> None:
    model, inputs = build()
    report = castwise.compare(model, inputs, policy="bf16-mixed")
    assert report.findings == []
    rows = report.to_dict()["numerics"]
    names = {row["module"] for row in rows}
    # every module that is called has a row (ModuleList is not called; MHA's out_proj is used functionally)
    called = {n for n, m in model.named_modules() if not isinstance(m, torch.nn.ModuleList) and "out_proj" not in n}
    assert names == called
    assert all(not row["past_tolerance"] for row in rows)
    # bf16 rounding is there and measured: errors are not zero, but within 4 * 2^-8
    linears = [row for row in rows if row["dtype"] == "bf16" and row["added_err"] not in (None, 0)]
    assert linears and all(0 < row["added_err"] <= row["tolerance"] == 4 * 2**-8 for row in linears)
    assert 0 < report.summary["output_err"] < 1e-2
    assert report.summary["first_past_tolerance"] is None


def test_planted_cancellation_ranks_first_and_is_the_first_past_tolerance() -> None:
    model, inputs = mlp(Cancel, where=2)
    report = castwise.compare(model, inputs, policy="bf16-mixed")
    ranked = report.to_dict()["numerics"]
    assert ranked[0]["module"] == "layers.2.0"
    assert report.summary["first_past_tolerance"] == "layers.2.0"
    assert [(f.code, f.module) for f in report.findings] == [("CW320", "layers.2.0")]
    rows = _rows(report)
    # the planted wrapper adds the error; the Linear inside it and the modules after it do not
    assert rows["layers.2.0.inner"]["added_err"] < rows["layers.2.0.inner"]["tolerance"]
    after = rows["norm"]
    assert after["inherited_err"] > after["tolerance"] > after["added_err"]
    assert after["out_err"] > after["tolerance"]


def test_tiny_epsilon_norm_in_f16_makes_nonfinite_and_is_named_as_the_producer() -> None:
    model, inputs = mlp(TinyEpsScale, where=1)
    report = castwise.compare(model, inputs, policy="16-true")
    assert report.findings[0].code == "CW321" and report.findings[0].module == "layers.1.0"
    assert not report.ok
    rows = _rows(report)
    assert rows["layers.1.0"]["added_err"] == "inf"
    # downstream modules inherit the nan; none of them is said to make it
    assert rows["out"]["inherited_err"] == "inf" and rows["out"]["added_err"] != "inf"
    assert math.isinf(report.summary["output_err"]) or math.isnan(report.summary["output_err"])
    assert "error CW321 module-makes-nonfinite-under-policy" in str(report)


def test_gradients_compared_in_train_and_not_in_eval() -> None:
    model, inputs = mlp(Cancel, where=2)
    train = _rows(castwise.compare(model, inputs, policy="bf16-mixed"))
    assert train["inp"]["grad_err"] is not None and train["inp"]["param_grad_err"] is not None
    # the planted module's error reaches the gradients of everything before it
    assert train["inp"]["grad_err"] > 4 * 2**-8
    evaluated = _rows(castwise.compare(model, inputs, policy="bf16-mixed", mode="eval"))
    assert evaluated["inp"]["grad_err"] is None and evaluated["inp"]["param_grad_err"] is None
    assert evaluated["layers.2.0"]["past_tolerance"]


def test_emulated_float8_rounds_linears_only() -> None:
    model, inputs = mlp()
    report = castwise.compare(model, inputs, policy="float8_e4m3fn", mode="eval")
    rows = _rows(report)
    assert rows["inp"]["dtype"] == "f8e4m3fn" and rows["norm"]["dtype"] == "f32"
    assert rows["norm"]["added_err"] == 0
    assert 2**-8 < rows["inp"]["added_err"] < rows["inp"]["tolerance"]
    assert report.summary["policy"] == "float8_e4m3fn"


def test_report_renders_and_serialises() -> None:
    model, inputs = mlp(Cancel, where=2)
    report = castwise.compare(model, inputs, policy="bf16-mixed")
    text = str(report)
    assert "warning CW320 module-adds-error-past-rounding" in text
    assert "first module past tolerance: `layers.2.0`" in text
    assert "layers.2.0 " in text.split("module ")[-1]
    data = json.loads(json.dumps(report.to_dict()))
    assert {"module", "out_err", "added_err", "inherited_err", "grad_err", "tolerance"} <= set(data["numerics"][0])
    assert data["findings"][0]["first"] is True and data["findings"][0]["rank"] == 1
    assert data["summary"]["reference"] == "32-true"


def test_the_users_model_and_global_state_are_unchanged() -> None:
    model, inputs = mlp(Cancel, where=2)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    castwise.compare(model, inputs, policy="16-true")
    assert not model.training
    assert all(torch.equal(before[k], v) and before[k].dtype == v.dtype for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert all(
        not m._forward_hooks and not m._forward_pre_hooks and "forward" not in m.__dict__ for m in model.modules()
    )
    assert torch.equal(torch.get_rng_state(), rng)
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_default_dtype() == torch.float32


def test_bad_arguments_say_what_is_valid() -> None:
    model, inputs = mlp()
    with pytest.raises(CastwiseError, match="valid: eval, train"):
        castwise.compare(model, inputs, policy="bf16-mixed", mode="both")
    with pytest.raises(PolicyError):
        castwise.compare(model, inputs, policy="bf17-mixed")
    with pytest.raises(CastwiseError, match=r"torch\.nn\.Module"):
        castwise.compare("model", inputs, policy="bf16-mixed")


class _ScalarLoss(torch.nn.Module):
    """Returns its loss as a scalar (no transformers output object)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.inner(x), y)


def test_the_metric_is_the_models_own_loss_where_it_returns_one_and_output_otherwise() -> None:
    torch.manual_seed(0)
    model, x, y = _ScalarLoss(), torch.randn(8, 16), torch.randint(0, 4, (8,))
    report = castwise.compare(model, (x, y), policy="bf16-mixed")
    with torch.no_grad():
        real = float(model(x, y))
    assert report.summary["metric"] == "loss"
    assert report.summary["loss_reference"] == pytest.approx(real, rel=1e-6)
    assert "loss (the model's own)" in str(report)
    # no loss returned: its output is the metric, and no projection of it is called a loss
    model, inputs = mlp()
    report = castwise.compare(model, inputs, policy="bf16-mixed")
    assert report.summary["metric"] == "output"
    assert report.summary["loss_reference"] is None and report.summary["loss_err"] is None
    assert "loss" not in str(report).split("\n\n")[1].split("(")[0]
    assert castwise.tune(model, inputs, policy="bf16-mixed", budget=1e-1).metric == "output"


def _gpt2_with_inline_norm() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """GPT-2 (from a config, cache on as it ships) whose second attention module normalises its
    output inline with an RMSNorm of epsilon 1e-12 (zero in float16) on small activations."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    attn = model.h[1].attn
    cls = type(attn)

    def forward(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        out, *rest = cls.forward(self, *args, **kwargs)
        g = out * 1e-4
        return (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + 1e-12), *rest)

    attn.__class__ = type("InlineNormAttention", (cls,), {"forward": forward})
    return model, {"input_ids": torch.randint(0, 100, (2, 12))}


def test_an_attention_module_that_fills_a_cache_runs_alone() -> None:
    pytest.importorskip("transformers")
    model, inputs = _gpt2_with_inline_norm()
    assert model.config.use_cache
    report = castwise.compare(model, inputs, policy="16-true")
    # the attention's own inline ops are the fault: it is run alone (its KV cache would hold the
    # whole reference run's keys, in float32) and ranked first
    assert report.summary["ranked"][0] == "h.1.attn"
    assert _rows(report)["h.1.attn"]["added_err"] is not None
    assert model.config.use_cache  # the copies' caches are off, not the user's
