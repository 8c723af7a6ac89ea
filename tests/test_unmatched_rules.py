"""A module rule that matches no module is a typo that silently changes the policy: apply warns
at the user's line with the selector that would match, and the audit gets the same facts from
``castwise.applied.unmatched_rules`` (CW123)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import castwise
from castwise import Policy, rules
from castwise.applied import unmatched_rules
from castwise.applied.inspection import resolve, unmatched_message

README = Path(__file__).parents[1] / "README.md"


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def tiny_t5() -> T5ForConditionalGeneration:
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4))


def tiny_qwen3() -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return Qwen3ForCausalLM(config)


def test_one_star_rule_on_a_llama_matches_nothing_and_suggests_double_star_and_the_exact_path() -> None:
    model = tiny_llama()
    policy = Policy.parse("bf16-true,keep[*.mlp]=f32")
    ((rule, suggestions),) = unmatched_rules(policy, model)
    assert str(rule) == "keep[*.mlp]=f32"
    assert suggestions == ["**.mlp", "model.layers.*.mlp"]
    # every suggestion is a real fix: it makes exactly the Llama's MLPs islands
    for selector in suggestions:
        islands = {
            n
            for n, d in resolve(Policy.parse(f"bf16-true,keep[{selector}]=f32"), model).items()
            if d.island == torch.float32 and d.island_reason and d.island_reason.startswith("rule")
        }
        assert islands == {"model.layers.0.mlp", "model.layers.1.mlp"}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("model.layer.*.mlp", ["model.layers.*.mlp"]),  # a misspelt segment
        ("*.mlpp", ["**.mlp", "model.layers.*.mlp"]),  # a misspelt name, one segment deep
        ("mlp", ["**.mlp", "model.layers.*.mlp"]),
        ("class:LlamaMlp", ["class:LlamaMLP"]),  # a class name in the wrong case
        ("class:NoSuchThing", []),
        ("re:.*\\.mlpx", []),
    ],
)
def test_suggestions_for_other_slips(selector: str, expected: list[str]) -> None:
    ((_, suggestions),) = unmatched_rules(Policy.parse(f"bf16-true,keep[{selector}]=f32"), tiny_llama())
    assert suggestions == expected


def test_rules_that_match_and_preset_rules_are_not_reported() -> None:
    model = tiny_llama()
    assert unmatched_rules(Policy.parse("bf16-true,keep[**.mlp]=f32,out[model.norm]=bf16"), model) == []
    # Apex O2 brings a BatchNorm rule: a Llama has no BatchNorm, and that is not the user's typo
    assert Policy.parse("O2").rules and unmatched_rules(Policy.parse("O2"), model) == []


def test_message_names_the_rule_the_model_and_the_fix() -> None:
    model = tiny_llama()
    ((rule, suggestions),) = unmatched_rules(Policy.parse("bf16-true,keep[*.mlp]=f32"), model)
    assert unmatched_message(rule, suggestions, model) == (
        "rule keep[*.mlp]=f32 matches no module of LlamaForCausalLM, so the policy runs without it; "
        "did you mean keep[**.mlp]=f32 or keep[model.layers.*.mlp]=f32?"
    )
    ((rule, none),) = unmatched_rules(Policy.parse("bf16-true,out[class:NoSuchThing]=bf16"), model)
    assert none == []
    assert unmatched_message(rule, none, model).endswith(
        "check the selector (globs match whole dotted names: '*' is one segment and '**' any number, "
        "so '*.wo' matches 'encoder.wo' but not 'encoder.block.0.wo' or 'wo_proj')"
    )


def test_apply_warns_at_the_callers_line_with_the_suggestion() -> None:
    model = tiny_llama()
    with pytest.warns(UserWarning) as caught:
        line = _line_of_next_statement()
        applied = castwise.apply(model, "bf16-true,keep[*.mlp]=f32")
    applied.remove()
    (w,) = [w for w in caught if "matches no module" in str(w.message)]
    assert "did you mean keep[**.mlp]=f32 or keep[model.layers.*.mlp]=f32?" in str(w.message)
    assert Path(w.filename) == Path(__file__) and w.lineno == line


def test_the_audit_reports_the_rule_once_as_a_finding_not_as_a_warning() -> None:
    """The audit applies the policy to its own copy: the rule that matches nothing is its CW123
    finding, not also a warning pointing into castwise."""
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = castwise.audit(model, torch.randn(2, 4), policy="bf16-true,keep[*.nope]=f32", mode="eval")
    assert not [w for w in caught if "matches no module" in str(w.message)]
    assert [f.code for f in report.findings if f.code == "CW123"] == ["CW123"]


def test_the_warning_points_past_every_castwise_frame() -> None:
    """Called through castwise's context manager form, the warning still names the user's line."""
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_of_next_statement()
        with castwise.apply(model, "bf16-true,keep[*.nope]=f32"):
            pass
    hits = [w for w in caught if "keep[*.nope]=f32 matches no module" in str(w.message)]
    assert hits and all(Path(w.filename) == Path(__file__) and w.lineno == line for w in hits)


def _line_of_next_statement() -> int:
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno + 1


def test_readme_rule_examples_match_real_transformers_module_names() -> None:
    """The README's keep[...]/out[...] examples select modules of real models (built from configs):
    `**.wo` every T5 feed-forward output projection, `**.q_norm` every Qwen3 query norm."""
    clauses = re.findall(r"`((?:keep|out)\[[^\]`]+\]=\w+)`", README.read_text())
    assert clauses, "the README shows no module rule"
    models = {"T5": tiny_t5(), "Qwen3": tiny_qwen3()}
    for clause in clauses:
        policy = Policy.parse(f"bf16-true,{clause}")
        matched = {name: unmatched_rules(policy, model) == [] for name, model in models.items()}
        assert any(matched.values()), f"README's {clause} matches no module of {sorted(models)}"
    wo = Policy.parse("bf16-true,keep[**.wo]=f32")
    t5_wo = [n for n, d in resolve(wo, models["T5"]).items() if d.island_reason == "rule keep[**.wo]=f32"]
    assert sorted(t5_wo) == [
        "decoder.block.0.layer.2.DenseReluDense.wo",
        "decoder.block.1.layer.2.DenseReluDense.wo",
        "encoder.block.0.layer.1.DenseReluDense.wo",
        "encoder.block.1.layer.1.DenseReluDense.wo",
    ]


def test_cw123_is_in_the_catalog_as_a_warning() -> None:
    rule = rules.get("CW123")
    assert (rule.name, rule.severity, rule.category) == ("policy-rule-matches-nothing", "warning", None)
    assert rules.get("policy-rule-matches-nothing") is rule


def test_findings_for_the_audit_carry_the_rule_and_the_suggested_fix() -> None:
    from castwise.auditor.session import unmatched_rule_findings

    (finding,) = unmatched_rule_findings(Policy.parse("bf16-true,keep[*.mlp]=f32"), tiny_llama(), ("eval",))
    assert (finding.code, finding.level, finding.modes) == ("CW123", "warning", ("eval",))
    assert finding.fix == "replace keep[*.mlp]=f32 with keep[**.mlp]=f32 or keep[model.layers.*.mlp]=f32"
    data = finding.to_dict()
    assert data["name"] == "policy-rule-matches-nothing"
    assert dict(finding.details)["suggestions"] == ["keep[**.mlp]=f32", "keep[model.layers.*.mlp]=f32"]
