"""compare(torch.compile(model), ..., reference="eager"): the compiled (Inductor) program against the
eager one per module, on real compiles of tiny models (each test compiles a few small graphs)."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config

import castwise
from castwise.errors import CastwiseError
from tests.numerics.plants import FusedCancel, mlp

PLANTED = "layers.2.0"


@pytest.fixture(scope="module")
def planted() -> tuple[torch.nn.Module, torch.nn.Module, dict, castwise.Report, dict]:
    model, inputs = mlp(FusedCancel, where=2)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dynamo = torch._dynamo.config.get_config_copy()
    inductor = inductor_config.get_config_copy()
    compiled = torch.compile(model)
    report = castwise.compare(compiled, inputs, policy="bf16-true", reference="eager")
    after = {
        "state": before,
        "dynamo": dynamo == torch._dynamo.config.get_config_copy(),
        "inductor": inductor == inductor_config.get_config_copy(),
        "entries": [
            type(e.guard_manager).__name__
            for e in torch._C._dynamo.eval_frame._debug_get_cache_entry_list(FusedCancel.forward.__code__)
        ],
    }
    return model, compiled, inputs, report, after


@pytest.mark.slow
def test_the_planted_divergence_is_named_first_and_emulating_casts_closes_it(planted) -> None:
    _model, _compiled, _inputs, report, _after = planted
    s = report.summary
    assert s["reference"] == "eager" and "compiled" in s["program"]
    assert s["first_divergent"] == PLANTED
    assert s["emulate_precision_casts_closes"] is True
    assert [(f.code, f.module) for f in report.findings] == [("CW322", PLANTED)]
    rows = {row["module"]: row for row in report.to_dict()["numerics"]}
    assert rows[""]["past_tolerance"] and rows[PLANTED]["past_tolerance"]
    assert rows[PLANTED]["emulated_vs_eager"] <= rows[PLANTED]["tolerance"]
    # both against float32: eager's bf16 chain loses h, the fused kernel keeps it
    assert rows[PLANTED]["eager_vs_f32"] > 10 * rows[PLANTED]["compiled_vs_f32"]
    text = str(report)
    assert f"first module where compiled and eager diverge: `{PLANTED}`" in text
    assert "emulate_precision_casts=True there: closes the gap" in text


@pytest.mark.slow
def test_the_users_model_compiled_module_and_torch_configs_are_unchanged(planted) -> None:
    model, compiled, inputs, _report, after = planted
    assert after["dynamo"] and after["inductor"]
    assert not inductor_config.emulate_precision_casts
    # the comparison compiled the plant alone; its Dynamo cache entries are invalidated (Dynamo
    # unlinks a deleted entry lazily)
    assert after["entries"] and set(after["entries"]) == {"DeletedGuardManagerWrapper"}
    assert not model.training
    assert all(torch.equal(after["state"][k], v) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert compiled._orig_mod is model
    with torch.no_grad():
        assert torch.allclose(compiled(*inputs), model(*inputs), atol=1e-5)


@pytest.mark.slow
def test_a_clean_model_names_nothing() -> None:
    model, inputs = mlp()
    report = castwise.compare(torch.compile(model), inputs, policy="bf16-true", reference="eager")
    assert report.summary["first_divergent"] is None
    assert report.findings == []
    assert report.summary["compiles"] == 1  # the whole model agrees: nothing below is compiled
    assert "first module where compiled and eager diverge: none" in str(report)


def test_reference_eager_needs_a_compiled_model() -> None:
    model, inputs = mlp()
    with pytest.raises(CastwiseError, match=r"torch\.compile\(model\)"):
        castwise.compare(model, inputs, policy="bf16-true", reference="eager")


def test_plain_compare_of_a_compiled_model_says_it_compared_the_eager_program() -> None:
    model, inputs = mlp()
    report = castwise.compare(torch.compile(model), inputs, policy="bf16-mixed", mode="eval")
    assert report.summary["program"].startswith("eager (the module torch.compile wraps")
    assert "program compared: eager" in str(report)
    assert castwise.compare(model, inputs, policy="bf16-mixed", mode="eval").summary["program"] == "eager"
