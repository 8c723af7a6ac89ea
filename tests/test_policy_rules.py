"""Module rules: selectors (class, glob on dotted segments, re:, predicate), conflicts, precedence,
the norm-island default and transformers' ``_keep_in_fp32_modules``, resolved on real modules."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from open_clip.transformer import LayerNormFp32
from torch import nn
from transformers import T5Config, T5EncoderModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

import castwise.policy as policy_module
from castwise import ModuleRule, Policy, RuleError
from castwise.applied.inspection import is_norm, resolve

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


class LayerNorm(nn.Module):
    """A user's own class that happens to be called LayerNorm (not torch's)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(8, 16)
        self.wo = nn.Linear(16, 8)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.ff = FeedForward()


class Toy(nn.Module):
    """Names chosen to trip substring matching: `wo` vs `word_embeddings`, `encoder` vs `encoders`."""

    _keep_in_fp32_modules: ClassVar[list[str]] = ["wo"]

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(10, 8)
        self.encoder = nn.ModuleList([Block(), Block()])
        self.encoders = nn.Linear(8, 8)
        self.wo = nn.Linear(8, 8)
        self.final_norm = nn.LayerNorm(8)


def islands(policy: Policy | str, model: nn.Module) -> dict[str, tuple[torch.dtype, str]]:
    decisions = resolve(Policy.parse(policy), model)
    return {n: (d.island, d.island_reason or "") for n, d in decisions.items() if d.island is not None}


def names_matching(selector: object, model: nn.Module) -> list[str]:
    rule = ModuleRule(selector, F32)  # type: ignore[arg-type]
    return [n for n, m in model.named_modules() if rule.matches(n, m)]


# -- selectors -------------------------------------------------------------------------------


def test_class_rule_by_type_matches_subclasses_and_prints_a_parsable_path() -> None:
    rule = ModuleRule(nn.LayerNorm, F32)
    assert rule.selector == "class:torch.nn.modules.normalization.LayerNorm"
    assert rule.matches("ln", LayerNormFp32(4))  # open_clip's subclass
    assert not rule.matches("lin", nn.Linear(2, 2)) and not rule.matches("mine", LayerNorm())
    assert Policy.parse(str(Policy().with_rules(rule))).rules == (rule,)


@pytest.mark.parametrize(
    ("selector", "matches_torch_ln", "matches_fp32_ln", "matches_user_ln"),
    [
        ("class:LayerNorm", True, True, True),  # a bare name matches any class so named
        ("class:torch.nn.LayerNorm", True, True, False),  # torch's re-export path, not the user's class
        ("class:torch.nn.modules.normalization.LayerNorm", True, True, False),
        ("class:open_clip.transformer.LayerNormFp32", False, True, False),
        ("class:LayerNormFp32", False, True, False),
        (f"class:{__name__}.LayerNorm", False, False, True),
    ],
)
def test_class_selector_strings(
    selector: str, matches_torch_ln: bool, matches_fp32_ln: bool, matches_user_ln: bool
) -> None:
    rule = ModuleRule(selector, F32)
    assert rule.matches("m", nn.LayerNorm(4)) is matches_torch_ln
    assert rule.matches("m", LayerNormFp32(4)) is matches_fp32_ln
    assert rule.matches("m", LayerNorm()) is matches_user_ln


def test_glob_star_is_one_dotted_segment_never_a_substring() -> None:
    toy = Toy()
    assert names_matching("*.wo", toy) == []  # `wo` sits at depth 4 or at the root
    assert names_matching("wo", toy) == ["wo"]
    assert names_matching("encoder.*.ff.wo", toy) == ["encoder.0.ff.wo", "encoder.1.ff.wo"]
    assert names_matching("encoder.?.norm", toy) == ["encoder.0.norm", "encoder.1.norm"]
    assert names_matching("encoder.[!0].norm", toy) == ["encoder.1.norm"]
    assert names_matching("*", toy) == ["", "word_embeddings", "encoder", "encoders", "wo", "final_norm"]
    # `?` is one character inside a segment, never the dot between two
    assert not ModuleRule("a?b", F32).matches("a.b", nn.Identity())


def test_glob_double_star_spans_any_number_of_segments() -> None:
    toy = Toy()
    assert names_matching("**.wo", toy) == ["encoder.0.ff.wo", "encoder.1.ff.wo", "wo"]
    assert names_matching("encoder.**", toy) == [
        "encoder",
        "encoder.0",
        "encoder.0.norm",
        "encoder.0.ff",
        "encoder.0.ff.wi",
        "encoder.0.ff.wo",
        "encoder.1",
        "encoder.1.norm",
        "encoder.1.ff",
        "encoder.1.ff.wi",
        "encoder.1.ff.wo",
    ]  # and not `encoders`
    assert names_matching("encoder.**.wi", toy) == ["encoder.0.ff.wi", "encoder.1.ff.wi"]
    assert "word_embeddings" not in names_matching("**.wo", toy)


def test_regex_selector_is_a_full_match_on_the_qualified_name() -> None:
    toy = Toy()
    assert names_matching(r"re:encoder\.\d+\.ff\.w[io]", toy) == [
        "encoder.0.ff.wi",
        "encoder.0.ff.wo",
        "encoder.1.ff.wi",
        "encoder.1.ff.wo",
    ]
    assert names_matching("re:wo", toy) == ["wo"]  # full match: not word_embeddings, not *.wo


def test_predicate_selector() -> None:
    rule = ModuleRule(lambda name, module: isinstance(module, nn.Linear) and name.endswith("wi"), BF16)
    assert [n for n, m in Toy().named_modules() if rule.matches(n, m)] == ["encoder.0.ff.wi", "encoder.1.ff.wi"]
    assert rule.selector_text.startswith("fn:")


def test_bad_rules_raise_rule_error() -> None:
    with pytest.raises(RuleError, match="rule kind 'cast' is not valid; valid: keep, out"):
        ModuleRule("*.wo", F32, "cast")  # type: ignore[arg-type]
    with pytest.raises(RuleError, match=r"rule dtype torch\.int8 is not valid; valid: bf16, f16, f32, f64"):
        ModuleRule("*.wo", torch.int8)
    with pytest.raises(RuleError, match="rule selector 3 is not valid; valid: a glob like"):
        ModuleRule(3, F32)  # type: ignore[arg-type]
    with pytest.raises(RuleError, match="empty rule selector"):
        ModuleRule(" ", F32)


# -- conflicts -------------------------------------------------------------------------------


def test_two_rules_that_disagree_on_one_module_raise_naming_both() -> None:
    policy = Policy.parse("bf16-true,keep[**.wo]=f32,keep[class:torch.nn.Linear]=f16")
    with pytest.raises(RuleError) as info:
        resolve(policy, Toy())
    assert str(info.value) == (
        "module 'encoder.0.ff.wo' (Linear) is matched by keep[**.wo]=f32 and keep[class:torch.nn.Linear]=f16, "
        "which disagree; make one selector narrower or drop one rule"
    )


def test_conflict_message_pinned() -> None:
    policy = Policy.parse("bf16-true,keep[**.wo]=f32,keep[re:.*\\.ff\\.wo]=f16")
    with pytest.raises(RuleError) as info:
        resolve(policy, Toy())
    assert str(info.value) == (
        "module 'encoder.0.ff.wo' (Linear) is matched by keep[**.wo]=f32 and keep[re:.*\\.ff\\.wo]=f16, "
        "which disagree; make one selector narrower or drop one rule"
    )


def test_rules_that_agree_or_differ_in_kind_are_not_a_conflict() -> None:
    decisions = resolve(Policy.parse("bf16-true,keep[**.wo]=f32,keep[class:Linear]=f32,out[**.wo]=bf16"), Toy())
    d = decisions["encoder.0.ff.wo"]
    assert (d.island, d.output) == (F32, BF16)


# -- precedence: user rule > _keep_in_fp32_modules > norms default ---------------------------


def test_precedence_is_documented_in_the_grammar_docstring() -> None:
    doc = policy_module.__doc__ or ""
    assert (
        "Rule precedence: a user's ``keep``/``out`` rules, then the model's ``_keep_in_fp32_modules``,\n"
        "then the ``norms`` default." in doc
    )


def test_precedence_user_rule_over_keep_in_fp32_over_norms() -> None:
    toy = Toy()
    assert islands("16-true", toy)["wo"] == (F32, "_keep_in_fp32_modules 'wo'")
    assert islands("16-true", toy)["final_norm"] == (F32, "norms")
    ruled = islands("16-true,keep[wo]=bf16,keep[final_norm]=bf16", toy)
    assert ruled["wo"] == (BF16, "rule keep[wo]=bf16")
    assert ruled["final_norm"] == (BF16, "rule keep[final_norm]=bf16")
    assert ruled["encoder.0.ff.wo"] == (F32, "_keep_in_fp32_modules 'wo'")


def test_keep_in_fp32_matches_whole_segments_not_substrings() -> None:
    got = islands("16-true", Toy())
    assert "word_embeddings" not in got  # transformers 5.x substring matching would island it
    assert {n for n, (_, why) in got.items() if why.startswith("_keep")} == {"encoder.0.ff.wo", "encoder.1.ff.wo", "wo"}


def test_keep_in_fp32_follows_transformers_dtype_conditions() -> None:
    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4)
    t5 = T5EncoderModel(config)
    wo = {"encoder.block.0.layer.1.DenseReluDense.wo", "encoder.block.1.layer.1.DenseReluDense.wo"}

    def kept(policy: str) -> set[str]:
        return {n for n, (_, why) in islands(policy, t5).items() if why.startswith("_keep")}

    assert kept("16-true") == wo  # transformers keeps `wo` f32 when loading in float16
    assert kept("16-mixed") == wo  # under f16 autocast `wo` runs as an f32 island (overflow)
    assert kept("bf16-true") == set() and kept("bf16-mixed") == set() and kept("32-true") == set()
    assert kept("16-true,keep_in_fp32=off") == set()
    # `_keep_in_fp32_modules_strict` holds for bfloat16 too
    t5._keep_in_fp32_modules_strict = ["wi"]  # type: ignore[assignment]
    assert kept("bf16-true") == {n.replace(".wo", ".wi") for n in wo}


# -- the norms default -----------------------------------------------------------------------

NORMS = {
    "layer_norm": nn.LayerNorm(8),
    "group_norm": nn.GroupNorm(2, 8),
    "batch_norm": nn.BatchNorm1d(8),
    "batch_norm2d": nn.BatchNorm2d(8),
    "rms_norm": nn.RMSNorm(8),
    "openclip_ln": LayerNormFp32(8),
    "t5_ln": T5LayerNorm(8),  # type: ignore[no-untyped-call]
    "llama_rms": LlamaRMSNorm(8),
}


def norm_zoo() -> nn.Module:
    model = nn.Module()
    for name, module in NORMS.items():
        model.add_module(name, module)
    model.add_module("linear", nn.Linear(8, 8))
    model.add_module("embedding", nn.Embedding(4, 8))
    return model


@pytest.mark.parametrize("name", ["16-true", "bf16-true", "openclip:bf16", "openclip:fp16"])
def test_norms_are_f32_islands_under_true_low_precision(name: str) -> None:
    assert islands(name, norm_zoo()) == {n: (F32, "norms") for n in NORMS}


@pytest.mark.parametrize("name", ["pure_fp16", "pure_bf16", "O3", "bf16-mixed", "16-mixed", "32-true", "64-true"])
def test_no_norm_islands_under_pure_mixed_or_full_precision(name: str) -> None:
    assert islands(name, norm_zoo()) == {}


def test_apex_o2_islands_batchnorm_only() -> None:
    assert islands("O2", norm_zoo()) == {
        "batch_norm": (F32, "rule keep[class:torch.nn.modules.batchnorm._BatchNorm]=f32"),
        "batch_norm2d": (F32, "rule keep[class:torch.nn.modules.batchnorm._BatchNorm]=f32"),
    }


def test_is_norm_recognises_library_norms_but_not_lookalikes() -> None:
    assert all(is_norm(m) for m in NORMS.values())
    assert not is_norm(nn.Linear(2, 2)) and not is_norm(nn.Identity())
    assert is_norm(LayerNorm())  # a library's own norm class, named like one, with a weight
    assert not is_norm(Block())  # a container holding a norm is not itself a norm


def test_an_island_inside_a_same_dtype_island_adds_nothing() -> None:
    got = islands("16-true,keep[encoder]=f32", Toy())
    assert got["encoder"] == (F32, "rule keep[encoder]=f32")
    assert not [n for n in got if n.startswith("encoder.")]  # inner norms and wo merge into it
    # a differently typed island inside stays
    got = islands("16-true,keep[encoder]=f32,keep[encoder.0.ff]=bf16", Toy())
    assert got["encoder.0.ff"] == (BF16, "rule keep[encoder.0.ff]=bf16")
    assert got["encoder.0.ff.wo"] == (F32, "_keep_in_fp32_modules 'wo'")
