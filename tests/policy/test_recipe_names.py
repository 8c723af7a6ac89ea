"""Every recipe name castwise documents from other tools parses, round-trips and means its recipe."""

from __future__ import annotations

import re

import pytest

from castwise import export
from castwise.errors import ExportError, PolicyError
from castwise.policy import Policy, vocab
from castwise.policy.float8 import Float8Recipe
from castwise.policy.toolnames import TE_RECIPES, TORCHAO_RECIPES
from castwise.policy.vocab import BRIDGE

NAMES = [
    "nvfp4",
    "mxfp4",
    "bf16-mixed,fp8=nvfp4",
    "bf16-mixed,fp8=mxfp4",
    "bf16-true,fp8=nvfp4",
    "megatron:--bf16 --fp8-format e4m3 --fp8-recipe mxfp8",
    "megatron:--bf16 --fp4-format e2m1",
    "--bf16 --fp4-format e2m1 --fp4-recipe nvfp4",
    "--fp16 --fp8-format hybrid --fp8-recipe tensorwise",
    *BRIDGE,
    *(n.replace("_", "-") for n in BRIDGE if n not in ("bf16_mixed",)),
    *(f"megatron-bridge:{n}" for n in BRIDGE),
    "bf16_with_mxfp8_bf16_params",
    "bf16_with_fp8_current_scaling_bf16_params_bf16_grad_reduce",
    "bf16_mixed_bf16_grad_reduce",
    *(f"te:{n}" for n in TE_RECIPES),
    *(f"torchao:{n}" for n in TORCHAO_RECIPES),
    *(f"bf16-mixed,fp8=te:{n}" for n in TE_RECIPES),
    "bf16-mixed,fp8=current",
    "bf16-mixed,fp8=subchannel:hybrid",
]


@pytest.mark.parametrize("name", NAMES)
def test_every_documented_name_parses_and_round_trips(name: str) -> None:
    p = Policy.parse(name)
    assert Policy.parse(str(p)) == p
    if not any(base in name.replace("-", "_") for base in ("bf16_mixed", "fp16_mixed")):  # Bridge's bases
        assert p.float8 is not None


@pytest.mark.parametrize(
    ("name", "means"),
    [
        ("nvfp4", "bf16-mixed,fp8=nvfp4"),
        ("te:NVFP4BlockScaling", "bf16-mixed,fp8=nvfp4"),
        ("te:Float8CurrentScaling", "bf16-mixed,fp8=tensorwise:hybrid"),
        ("te:Float8BlockScaling", "bf16-mixed,fp8=blockwise:e4m3"),
        ("te:MXFP8BlockScaling", "mxfp8"),
        ("te:DelayedScaling", "bf16-mixed,fp8=delayed:hybrid"),
        ("torchao:rowwise_with_gw_hp", "bf16-mixed,fp8=rowwise"),
        ("torchao:mxfp4_cutlass", "mxfp4"),
        ("bf16_with_nvfp4_mixed", "--bf16,fp8=nvfp4"),
        ("bf16-with-mxfp8-mixed", "--bf16,fp8=mxfp8:e4m3"),
        ("fp16_with_fp8_subchannel_scaling_mixed", "--fp16,fp8=blockwise:hybrid"),
        ("bf16_with_fp8_current_scaling_bf16_grad_reduce", "--bf16,reduce=bf16,fp8=tensorwise:hybrid"),
        ("megatron:--bf16 --fp4-format e2m1", "--bf16,fp8=nvfp4"),
        # Lightning's bf16-mixed stays Lightning's: Bridge registers the same hyphenated name
        ("bf16-mixed", "params=f32,compute=bf16"),
    ],
)
def test_names_mean_their_recipes(name: str, means: str) -> None:
    assert Policy.parse(name) == Policy.parse(means)


def test_fp4_recipes_are_e2m1_in_their_blocks() -> None:
    nv, mx = Float8Recipe.parse("nvfp4"), Float8Recipe.parse("mxfp4")
    assert (nv.format, nv.block, nv.fp4, mx.block) == ("e2m1", 16, True, 32)
    assert nv.forward_dtype == "float4_e2m1fn_x2" and not Float8Recipe.parse("mxfp8").fp4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bf16-mixed,fp8=nvfp4:e4m3", "nvfp4 takes e2m1"),
        ("bf16-mixed,fp8=mxfp8:e2m1", "mxfp8 takes e4m3, e5m2, hybrid"),
        ("te:Float9Scaling", "unknown te recipe 'Float9Scaling'; valid: DelayedScaling"),
        ("torchao:int4", "unknown torchao recipe"),
        ("megatron-bridge:bf16_with_fp6_mixed", "unknown Megatron-Bridge recipe"),
        ("--bf16 --fp4-format e3m0", "valid: e2m1"),
        ("--bf16 --fp8-format hybrid --fp4-format e2m1", "cannot be used simultaneously"),
    ],
)
def test_bad_names_say_what_is_valid(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        Policy.parse(text)


@pytest.mark.parametrize("name", sorted(BRIDGE))
def test_megatron_bridge_names_export_back_to_a_recipe_that_means_them(name: str) -> None:
    got = export.megatron_bridge(name)["mixed_precision"]
    assert Policy.parse(got) == Policy.parse(name)


def test_exports_say_what_each_tool_takes_of_fp4() -> None:
    titan = export.torchtitan("mxfp4")
    assert titan["quantize"]["linear"]["mx"]["recipe_name"] == "mxfp4_cutlass"
    with pytest.raises(ExportError, match="4-bit"):
        export.accelerate("nvfp4", strict=True)
    with pytest.raises(ExportError, match="torchtitan"):
        export.torchtitan("nvfp4", strict=True)
    with pytest.raises(ExportError, match="no Megatron-Bridge recipe means"):
        export.megatron_bridge("bf16-mixed,fp8=rowwise")


# Every recipe name the tools document, with what the tool runs, written out from each tool's own
# source (not from castwise's tables): NVIDIA/TransformerEngine transformer_engine/common/recipe/
# __init__.py; pytorch/ao torchao/float8/config.py Float8LinearRecipeName, the MXLinearRecipeName
# values, torchao/prototype/moe_training/config.py, the quantize_ configs' defaults; pytorch/torchtitan
# torchtitan/components/quantization/ (converters, recipe_name defaults); NVIDIA/Megatron-LM
# transformer_config.py / arguments.py / fp8_utils.py get_fp8_recipe.
CATALOGUE: list[tuple[str, str]] = [
    # TransformerEngine: class -> scaling and its fp8_format default (HYBRID for the per-tensor two)
    ("te:DelayedScaling", "delayed:hybrid"),
    ("te:Float8CurrentScaling", "tensorwise:hybrid"),
    ("te:Float8BlockScaling", "blockwise:e4m3"),
    ("te:MXFP8BlockScaling", "mxfp8:e4m3"),
    ("te:NVFP4BlockScaling", "nvfp4"),
    ("te:recipe.DelayedScaling()", "delayed:hybrid"),
    ("te:transformer_engine.common.recipe.MXFP8BlockScaling(fp8_format=Format.HYBRID)", "mxfp8:hybrid"),
    ("te:DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=16, amax_compute_algo='max')", "delayed:e4m3"),
    ("te:Float8CurrentScaling(fp8_format=Format.E4M3)", "tensorwise:e4m3"),
    ("te:Float8BlockScaling(fp8_format=Format.HYBRID, x_block_scaling_dim=1)", "blockwise:hybrid"),
    ("te:NVFP4BlockScaling(fp4_format=Format.E2M1, disable_rht=True)", "nvfp4"),
    ("te:delayedscaling", "delayed:hybrid"),
    # torchao: Float8LinearRecipeName, MXLinearRecipeName, the MoE training recipes
    ("torchao:tensorwise", "tensorwise"),
    ("torchao:rowwise", "rowwise"),
    ("torchao:rowwise_with_gw_hp", "rowwise"),
    ("torchao:fp8_rowwise", "rowwise"),
    ("torchao:mxfp8_emulated", "mxfp8"),
    ("torchao:mxfp8_cublas", "mxfp8"),
    ("torchao:mxfp8_cublas_rceil", "mxfp8"),
    ("torchao:mxfp8_rceil", "mxfp8"),
    ("torchao:mxfp8_rceil_wgrad_with_hp", "mxfp8"),
    ("torchao:mxfp8_emulated_rceil", "mxfp8"),
    ("torchao:mxfp4_emulated", "mxfp4"),
    ("torchao:mxfp4_cutlass", "mxfp4"),
    # torchao quantize_ configs (training and inference), by their defaults and arguments
    ("torchao:Float8LinearConfig", "tensorwise"),
    ("torchao:Float8TrainingOpConfig", "rowwise"),
    ("torchao:Float8TrainingOpConfig(float8_linear_recipe='tensorwise')", "tensorwise"),
    ("torchao:Float8DynamicActivationFloat8WeightConfig", "tensorwise"),
    ("torchao:Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())", "rowwise"),
    ("torchao:Float8StaticActivationFloat8WeightConfig", "tensorwise"),
    ("torchao:Float8WeightOnlyConfig", "tensorwise"),
    ("torchao:Float8FakeQuantizeConfig", "rowwise"),
    ("torchao:Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn, granularity=PerTensor())", "tensorwise"),
    ("torchao:Float8BlockwiseLinearConfig", "blockwise"),
    ("torchao:MXLinearConfig", "mxfp8"),
    ("torchao:MXLinearConfig(elem_dtype=torch.float4_e2m1fn_x2)", "mxfp4"),
    ("torchao:MXFP8TrainingOpConfig", "mxfp8"),
    ("torchao:MXFPInferenceConfig", "mxfp8"),
    ("torchao:MXDynamicActivationMXWeightConfig", "mxfp8"),
    ("torchao:MXDynamicActivationMXWeightConfig(activation_dtype=torch.float4_e2m1fn_x2)", "mxfp4"),
    ("torchao:MXFakeQuantizeConfig", "mxfp4"),
    ("torchao:NVFP4TrainingConfig", "nvfp4"),
    ("torchao:NVFP4InferenceConfig", "nvfp4"),
    ("torchao:NVFP4FakeQuantizeConfig", "nvfp4"),
    ("torchao:NVFP4DynamicActivationNVFP4WeightConfig", "nvfp4"),
    ("torchao:NVFP4WeightOnlyConfig", "nvfp4"),
    ("torchao:MoETrainingConfig", "rowwise"),
    # torchao's enums and factories as Python writes them
    ("torchao:Float8LinearRecipeName.ROWWISE_WITH_GW_HP", "rowwise"),
    ("torchao:MXLinearRecipeName.MXFP4_CUTLASS", "mxfp4"),
    ("torchao:Float8LinearConfig.from_recipe_name('rowwise')", "rowwise"),
    ("torchao:MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)", "mxfp8"),
    ("torchao:Float8DynamicActivationFloat8WeightConfig(granularity=[PerRow(), PerRow()])", "rowwise"),
    # torchtitan: the TOML converters (and their section's recipe_name), the Python converter configs
    ("torchtitan:float8", "tensorwise"),
    ("torchtitan:quantize.linear.float8", "tensorwise"),
    ("torchtitan:quantize.linear.float8:rowwise", "rowwise"),
    ("torchtitan:quantize.linear.float8:rowwise_with_gw_hp", "rowwise"),
    ("torchtitan:quantize.grouped_mm.float8", "rowwise"),
    ("torchtitan:mx", "mxfp8"),
    ("torchtitan:quantize.linear.mx", "mxfp8"),
    ("torchtitan:quantize.linear.mx:mxfp4_cutlass", "mxfp4"),
    ("torchtitan:quantize.grouped_mm.mx:mxfp8", "mxfp8"),
    ("torchtitan:Float8LinearConverter", "rowwise"),
    ("torchtitan:Float8LinearConverter.Config(recipe_name='rowwise_with_gw_hp')", "rowwise"),
    ("torchtitan:Float8GroupedExpertsConverter", "rowwise"),
    ("torchtitan:MXFP8LinearConverter", "mxfp8"),
    ("torchtitan:MXFP8GroupedExpertsConverter.Config(recipe_name='mxfp8_rceil', pad_multiple=32)", "mxfp8"),
    ("torchtitan:NVFP4LinearConverter", "nvfp4"),
]


@pytest.mark.parametrize(("name", "fp8"), CATALOGUE)
def test_every_tool_recipe_name_parses_to_what_the_tool_runs(name: str, fp8: str) -> None:
    p = Policy.parse(name)
    assert p.float8 == Float8Recipe.parse(fp8)
    assert p.replace(float8=None) == Policy.parse("bf16-mixed")  # the tools run their GEMMs over bf16
    assert Policy.parse(str(p)) == p
    assert Policy.parse(f"bf16-true,fp8={name},keep[*.head]=f32").float8 == Float8Recipe.parse(fp8)


@pytest.mark.parametrize(
    ("name", "differs"),
    [
        ("torchao:rowwise_with_gw_hp", "grad_weight"),
        ("torchao:Float8LinearConfig.from_recipe_name(Float8LinearRecipeName.ROWWISE_WITH_GW_HP)", "grad_weight"),
        ("torchtitan:quantize.linear.float8:rowwise_with_gw_hp", "grad_weight"),
        ("torchao:Float8WeightOnlyConfig", "weights only"),
        ("te:NVFP4BlockScaling(backward_override='high_precision')", "backward GEMMs in high precision"),
    ],
)
def test_where_castwise_differs_from_the_tool_the_description_says_so(name: str, differs: str) -> None:
    assert differs in Policy.parse(name).describe()
    assert differs in " ".join(vocab.notes(name))


@pytest.mark.parametrize("name", ["te:DelayedScaling", "torchao:rowwise", "torchtitan:quantize.linear.mx"])
def test_a_plain_name_carries_no_note(name: str) -> None:
    assert "(" not in Policy.parse(name).describe().rsplit(";", 1)[-1].split("GEMMs in Linears", 1)[-1][3:]
    assert vocab.notes(name) == ()


# NVIDIA/Megatron-LM: args.fp8 / args.fp4 (--fp8-format / --fp4-format) turn the GEMMs on;
# fp8_utils.get_fp8_recipe picks the class from --fp8-recipe (default delayed)
MEGATRON: list[tuple[str, str]] = [
    ("--bf16 --fp8-format hybrid", "--bf16,fp8=delayed:hybrid"),
    ("--bf16 --fp8-format e4m3 --fp8-recipe tensorwise", "--bf16,fp8=tensorwise:e4m3"),
    ("--bf16 --fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather", "--bf16,fp8=blockwise:e4m3"),
    ("--bf16 --fp8-format=hybrid --fp8-recipe=mxfp8 --reuse-grad-buf-for-mxfp8-param-ag", "--bf16,fp8=mxfp8:hybrid"),
    (
        "--bf16 --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-margin 0",
        "--bf16,fp8=delayed:hybrid",
    ),
    ("--bf16 --fp4-format e2m1 --fp4-recipe nvfp4 --fp4-param-gather", "--bf16,fp8=nvfp4"),
    (
        "--bf16 --fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-start-in-bf16 2",
        "--bf16,fp8=tensorwise:hybrid",
    ),
    ("--bf16 --grad-reduce-in-bf16 --fp8-format e4m3 --fp8-recipe mxfp8", "--bf16,reduce=bf16,fp8=mxfp8"),
    ("--fp16 --fp8-format hybrid --fp8-dot-product-attention", "--fp16,fp8=delayed:hybrid"),
    # Megatron-LM before 2023-08: --fp8-e4m3 / --fp8-hybrid
    ("--bf16 --fp8-hybrid", "--bf16,fp8=delayed:hybrid"),
    ("--bf16 --fp8-e4m3 --no-fp8-wgrad", "--bf16,fp8=delayed:e4m3"),
    # Megatron runs bf16 with no float8 when --fp8-format is absent: the recipe flags are inert
    ("--bf16 --fp8-recipe mxfp8", "--bf16"),
    ("--bf16 --fp4-recipe nvfp4", "--bf16"),
    ("--bf16 --fp8-param-gather --fp8-recipe tensorwise", "--bf16"),
]


@pytest.mark.parametrize(("flags", "means"), MEGATRON)
def test_megatron_flags_mean_what_megatron_runs(flags: str, means: str) -> None:
    for text in (flags, f"megatron:{flags}"):
        p = Policy.parse(text)
        assert p == Policy.parse(means)
        assert Policy.parse(str(p)) == p


def test_an_fp8_recipe_without_a_format_is_said_to_be_inert() -> None:
    said = vocab.notes("megatron:--bf16 --fp8-recipe mxfp8")
    assert said and "--fp8-recipe is inert" in said[0] and "--fp8-format" in said[0]
    assert vocab.notes("--bf16 --fp8-format e4m3 --fp8-recipe mxfp8") == ()  # the look-alike that runs fp8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("te:DelayedScaling(fp8_format=Format.E5M2)", "Pure E5M2 training is not supported"),
        ("te:NVFP4BlockScaling(fp8_format=Format.HYBRID)", "valid: E4M3"),
        ("te:DelayedScaling(history=3)", "takes no history"),
        ("te:CustomRecipe(qfactory=f)", "qfactory castwise cannot read"),
        ("torchao:Float8DynamicActivationFloat8WeightConfig(granularity=PerBlock())", "valid: PerRow(), PerTensor()"),
        ("torchtitan:quantize.linear.float8:mxfp8_cublas", "takes no recipe_name 'mxfp8_cublas'; valid:"),
        ("torchtitan:quantize.linear.fp8", "unknown torchtitan converter recipe"),
        ("--bf16 --fp8-format hybrid --fp8-recipe custom", "custom recipe"),
        ("--bf16 --fp8-format hybrid --first-last-layers-bf16", "refuses --first-last-layers-bf16 with delayed"),
        ("--bf16 --fp8-format e5m2", "valid: e4m3, hybrid"),
        ("--bf16 --fp8-wgrad-off", "not one castwise reads"),
        ("--bf16 --fp8-e4m3 --fp8-hybrid", "refuses --fp8-e4m3 with --fp8-hybrid"),
    ],
)
def test_names_the_tools_refuse_say_what_is_valid(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(message)):
        Policy.parse(text)
