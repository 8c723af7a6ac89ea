"""Every recipe name castwise documents from other tools parses, round-trips and means its recipe."""

from __future__ import annotations

import pytest

from castwise import export
from castwise.errors import ExportError, PolicyError
from castwise.policy import Policy
from castwise.policy.float8 import TE_RECIPES, TORCHAO_RECIPES, Float8Recipe
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
        ("--bf16 --fp8-format hybrid --fp4-format e2m1", "float8 or float4 GEMMs, not both"),
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
