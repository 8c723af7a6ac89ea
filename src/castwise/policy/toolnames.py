"""Other tools' names for a GEMM recipe, read from their own source (torch-free: lint-config reads them).

Written ``TOOL:NAME``, as the whole policy (over ``bf16-mixed``) or as an ``fp8=`` value, any case,
with the tool's module path or call arguments as users write them
(``te:recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=16)``,
``torchao:Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``,
``torchtitan:quantize.linear.mx:mxfp8_cublas``). Each table cites the file it was read from; where
castwise's emulation differs from what the tool runs, ``DIFFERS`` says how, and the recipe's
``describe()`` repeats it.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

from castwise.errors import PolicyError

__all__ = ["DIFFERS", "TE_RECIPES", "TOOLS", "TORCHAO_RECIPES", "TORCHTITAN_CONVERTERS", "named", "note"]

# NVIDIA/TransformerEngine transformer_engine/common/recipe/__init__.py: each Recipe class, its
# fp8_format default, and the formats its __post_init__ accepts (every one asserts
# "Pure E5M2 training is not supported."; NVFP4BlockScaling takes fp4_format=E2M1, fp8_format=E4M3)
TE_RECIPES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "DelayedScaling": ("delayed", "HYBRID", ("HYBRID", "E4M3")),
    "Float8CurrentScaling": ("tensorwise", "HYBRID", ("HYBRID", "E4M3")),
    "Float8BlockScaling": ("blockwise", "E4M3", ("HYBRID", "E4M3")),
    "MXFP8BlockScaling": ("mxfp8", "E4M3", ("HYBRID", "E4M3")),
    "NVFP4BlockScaling": ("nvfp4", "E4M3", ("E4M3",)),
}
# their other fields (same file): scale bookkeeping, attention and kernel choices that leave
# each GEMM's operand format and block as above
_TE_ARGS = frozenset(
    {
        "margin",
        "interval",
        "amax_history_len",
        "amax_compute_algo",
        "scaling_factor_compute_algo",
        "reduce_amax",
        "fp8_dpa",
        "fp8_mha",
        "use_power_2_scales",
        "fp8_quant_fwd_inp",
        "fp8_quant_fwd_weight",
        "fp8_quant_bwd_grad",
        "fp8_gemm_fprop",
        "fp8_gemm_dgrad",
        "fp8_gemm_wgrad",
        "use_f32_scales",
        "x_block_scaling_dim",
        "w_block_scaling_dim",
        "grad_block_scaling_dim",
        "enable_2d_quantization",
        "disable_rht",
        "disable_stochastic_rounding",
        "disable_2d_quantization",
        "row_scaled_activation",
        "nvfp4_4over6",
        "nvfp4_4over6_e4m3_use_256",
        "nvfp4_4over6_err_mode",
        "fp4_format",
        "override_linear_precision",
        "backward_override",
    }
)
_TE_HP_BACKWARD = ("high_precision", "dequantized")  # recipe/__init__.py _BACKWARD_OVERRIDES

# pytorch/ao: torchao/float8/config.py Float8LinearRecipeName; the MXLinearRecipeName values
# (torchao/prototype/mx_formats/config.py before #3968, still what torchtitan's toml passes) and
# the early mxfp8_cutlass; torchao/prototype/moe_training/config.py Float8TrainingRecipe and
# MXFP8TrainingRecipe; and the quantize_ config classes for float8 / MX / NVFP4 training and
# inference (torchao/quantization/quant_api.py, torchao/prototype/mx_formats/inference_workflow.py,
# torchao/prototype/moe_training/, torchao/prototype/blockwise_fp8_training/linear.py,
# torchao/prototype/qat/{mx,nvfp4}.py, torchao/quantization/qat/fake_quantize_config.py), each by
# its defaults (Float8DynamicActivationFloat8WeightConfig: granularity None = PerTensor;
# Float8TrainingOpConfig: float8_linear_recipe "rowwise"; MXFakeQuantizeConfig: float4_e2m1fn_x2;
# MXLinearConfig / MXDynamicActivationMXWeightConfig: float8_e4m3fn)
TORCHAO_RECIPES: dict[str, str] = {
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_with_gw_hp": "rowwise",
    "fp8_rowwise": "rowwise",
    "mxfp8_emulated": "mxfp8",
    "mxfp8_cublas": "mxfp8",
    "mxfp8_cublas_rceil": "mxfp8",
    "mxfp8_cutlass": "mxfp8",
    "mxfp8_rceil": "mxfp8",
    "mxfp8_rceil_wgrad_with_hp": "mxfp8",
    "mxfp8_emulated_rceil": "mxfp8",
    "mxfp4_emulated": "mxfp4",
    "mxfp4_cutlass": "mxfp4",
    "Float8LinearConfig": "tensorwise",
    "Float8TrainingOpConfig": "rowwise",
    "MoETrainingConfig": "rowwise",
    "Float8DynamicActivationFloat8WeightConfig": "tensorwise",
    "Float8StaticActivationFloat8WeightConfig": "tensorwise",
    "Float8DynamicActivationFloat8WeightOpaqueTensorConfig": "tensorwise",
    "Float8WeightOnlyConfig": "tensorwise",
    "Float8FakeQuantizeConfig": "rowwise",
    "Float8BlockwiseLinearConfig": "blockwise",
    "MXLinearConfig": "mxfp8",
    "MXFP8TrainingOpConfig": "mxfp8",
    "MXFPInferenceConfig": "mxfp8",
    "MXDynamicActivationMXWeightConfig": "mxfp8",
    "MXFakeQuantizeConfig": "mxfp4",
    "NVFP4TrainingConfig": "nvfp4",
    "NVFP4InferenceConfig": "nvfp4",
    "NVFP4FakeQuantizeConfig": "nvfp4",
    "NVFP4DynamicActivationNVFP4WeightConfig": "nvfp4",
    "NVFP4WeightOnlyConfig": "nvfp4",
}
_TORCHAO_FP4_DTYPES = ("float4_e2m1fn_x2", "fp4_e2m1")  # an MX elem dtype that makes the config MXFP4
# a config argument that names the granularity or the recipe
_TORCHAO_GRANULARITY = {"PerTensor": "tensorwise", "PerRow": "rowwise"}

# pytorch/torchtitan: the converters' registry names of the TOML releases
# (torchtitan/components/quantization/{float8,mx}.py register_model_converter, before #2386; "float8"
# and "mx" the older ones) and the converter classes of the Python configs
# (torchtitan/components/quantization/{float8,mx,nvfp4}.py), each with the recipe family its
# recipe_name takes and its default: [quantize.linear.float8] recipe_name None = tensorwise
# (config/job_config.py Float8Linear), Float8LinearConverter.Config recipe_name "rowwise",
# [quantize.linear.mx] "mxfp8_cublas", [quantize.grouped_mm.mx] "mxfp8", grouped float8 rowwise
# (MoETrainingConfig), MXFP8GroupedExpertsConverter "mxfp8_rceil"
_F8 = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # Float8LinearRecipeName
_MX = ("mxfp8_emulated", "mxfp8_cublas", "mxfp8_cublas_rceil", "mxfp4_emulated", "mxfp4_cutlass")  # MXLinearRecipeName
# converter -> (recipe_name default, the recipe_names it takes)
TORCHTITAN_CONVERTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "float8": ("tensorwise", _F8),
    "quantize.linear.float8": ("tensorwise", _F8),
    "quantize.grouped_mm.float8": ("fp8_rowwise", ("fp8_rowwise",)),
    "Float8LinearConverter": ("rowwise", ("rowwise", "rowwise_with_gw_hp")),
    "Float8GroupedExpertsConverter": ("fp8_rowwise", ("fp8_rowwise",)),
    "mx": ("mxfp8_cublas", _MX),
    "quantize.linear.mx": ("mxfp8_cublas", _MX),
    "quantize.grouped_mm.mx": ("mxfp8", ("mxfp8",)),
    "MXFP8LinearConverter": ("mxfp8_rceil", ("mxfp8_rceil",)),
    "MXFP8GroupedExpertsConverter": ("mxfp8_rceil", ("mxfp8_rceil",)),
    "NVFP4LinearConverter": ("nvfp4", ("nvfp4",)),
}
# the grouped-GEMM recipe names torchtitan passes that are no torchao Linear recipe name
_TITAN_ONLY = {"mxfp8": "mxfp8", "nvfp4": "nvfp4"}

# where castwise's reading differs from what the tool runs (the recipe's describe() says it)
DIFFERS: dict[str, str] = {
    "rowwise_with_gw_hp": "torchao keeps grad_weight's GEMM in high precision; castwise rounds it too",
    "mxfp8_rceil_wgrad_with_hp": "torchao keeps grad_weight's GEMM in high precision; castwise rounds it too",
    "Float8WeightOnlyConfig": "torchao rounds the weights only (activations stay bf16); castwise rounds both",
    "NVFP4WeightOnlyConfig": "torchao rounds the weights only (activations stay bf16); castwise rounds both",
    "Float8StaticActivationFloat8WeightConfig": "torchao scales activations by a calibrated static scale; "
    "castwise by the current amax",
    "Float8BlockwiseLinearConfig": "torchao scales activations in 1x128 and weights in 128x128 blocks",
}

_Values = Mapping[str, str]


def _call(text: str) -> tuple[str, dict[str, str]]:
    """``Name(k=v, ...)`` (a dotted module path allowed) -> (Name, {k: v as its last identifier or
    literal}); a bare name has no arguments."""
    text = text.strip()
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise PolicyError(f"{text!r} is not a recipe name or a call like Name(key=value, ...)") from None
    args: dict[str, str] = {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _FACTORIES:
        # Float8LinearConfig.from_recipe_name("rowwise"), MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.X)
        if len(node.args) + len(node.keywords) != 1:
            raise PolicyError(f"{text!r}: {node.func.attr} takes one recipe name")
        return _word(node.args[0] if node.args else node.keywords[0].value), {}
    if isinstance(node, ast.Call):
        if node.args:
            raise PolicyError(f"{text!r}: write the recipe's arguments by keyword (key=value)")
        for kw in node.keywords:
            if kw.arg is None:
                raise PolicyError(f"{text!r}: **kwargs cannot be read; write each argument as key=value")
            args[kw.arg] = _word(kw.value)
        node = node.func
    return _word(node), args


_FACTORIES = ("from_recipe_name", "from_recipe")  # torchao's configs made from a recipe name


def _word(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr  # recipe.Format.E4M3 -> E4M3, torch.float4_e2m1fn_x2 -> float4_e2m1fn_x2
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.Call):
        return _word(node.func)  # PerRow() -> PerRow
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts and len({_word(e) for e in node.elts}) == 1:
        return _word(node.elts[0])  # granularity=[PerRow(), PerRow()]: activation and weight alike
    return ast.unparse(node)


def _lookup(table: Mapping[str, object], name: str, tool: str) -> str:
    found = {k.lower(): k for k in table}.get(name.lower())
    if found is None:
        raise PolicyError(f"unknown {tool} recipe {name!r}; valid: {', '.join(sorted(table))}")
    return found


def _te(text: str) -> str:
    name, args = _call(text)
    if name == "CustomRecipe":
        raise PolicyError(
            "te:CustomRecipe quantizes through a qfactory castwise cannot read; name the built-in recipe "
            f"its quantizers follow: {', '.join(sorted(TE_RECIPES))}"
        )
    key = _lookup(TE_RECIPES, name, "te")
    scaling, default, formats = TE_RECIPES[key]
    unknown = sorted(set(args) - _TE_ARGS - {"fp8_format"})
    if unknown:
        raise PolicyError(
            f"te:{key} takes no {', '.join(unknown)}; its arguments: {', '.join(sorted(_TE_ARGS | {'fp8_format'}))}"
        )
    fmt = args.get("fp8_format", default).upper()
    if fmt not in formats:
        why = "Pure E5M2 training is not supported" if fmt == "E5M2" else "not a Format"
        raise PolicyError(
            f"te:{key}(fp8_format={fmt}) is refused by TransformerEngine ({why}); valid: {', '.join(formats)}"
        )
    if args.get("fp4_format", "E2M1").upper() != "E2M1":
        raise PolicyError(f"te:{key}(fp4_format={args['fp4_format']}): TransformerEngine takes E2M1 only")
    if scaling == "nvfp4":
        return "nvfp4"
    return f"{scaling}:{fmt.lower()}"


def _torchao(text: str) -> str:
    name, args = _call(text)
    key = _lookup(TORCHAO_RECIPES, name, "torchao")
    value = TORCHAO_RECIPES[key]
    dtypes = {args[k] for k in ("elem_dtype", "dtype", "activation_dtype", "weight_dtype") if k in args}
    if value.startswith("mx") and dtypes & set(_TORCHAO_FP4_DTYPES):
        value = "mxfp4"
    elif value.startswith("mx") and dtypes and not any("e4m3" in d for d in dtypes):
        raise PolicyError(f"torchao:{key} with {', '.join(sorted(dtypes))}: castwise reads e4m3 or e2m1 MX elements")
    granularity = args.get("granularity")
    if granularity is not None and value in ("tensorwise", "rowwise"):
        if granularity not in _TORCHAO_GRANULARITY:
            raise PolicyError(f"torchao:{key}(granularity={granularity}): valid: PerRow(), PerTensor()")
        value = _TORCHAO_GRANULARITY[granularity]
    recipe = args.get("recipe_name") or args.get("float8_linear_recipe")
    if recipe is not None:
        value = TORCHAO_RECIPES[_lookup(TORCHAO_RECIPES, recipe, "torchao")]
    if "e5m2" in "".join(dtypes) and value in ("tensorwise", "rowwise"):
        value += ":e5m2"
    return value


def _torchtitan(text: str) -> str:
    text = text.strip()
    if "(" in text:  # the Python config: Float8LinearConverter.Config(recipe_name="rowwise")
        name, args = _call(text.replace(".Config(", "("))
        conv, recipe = name, args.get("recipe_name", "")
    else:  # the TOML's converter name, with its section's recipe_name after a colon
        conv, _, recipe = text.partition(":")
    key = _lookup(TORCHTITAN_CONVERTERS, conv.strip(), "torchtitan converter")
    default, names = TORCHTITAN_CONVERTERS[key]
    wanted = recipe.strip() or default
    found = {k.lower(): k for k in names}.get(wanted.lower())
    if found is None:
        raise PolicyError(f"torchtitan {key} takes no recipe_name {wanted!r}; valid: {', '.join(sorted(names))}")
    return TORCHAO_RECIPES.get(found) or _TITAN_ONLY[found]


TOOLS = {"te": _te, "torchao": _torchao, "torchtitan": _torchtitan}


def named(text: str) -> str | None:
    """castwise's fp8= value for ``TOOL:NAME``; None when ``text`` names no tool of ``TOOLS``.
    PolicyError for a name (or argument) the tool does not take."""
    tool, colon, name = text.strip().partition(":")
    read = TOOLS.get(tool.strip().lower()) if colon else None
    return read(name) if read is not None else None


def note(text: str) -> str:
    """How castwise's reading of ``TOOL:NAME`` differs from the tool ('' where it does not)."""
    tool, colon, name = text.strip().partition(":")
    if not colon or tool.strip().lower() not in TOOLS:
        return ""
    text = name.strip()
    args: dict[str, str] = {}
    if "(" in text:
        try:
            call, args = _call(text.replace(".Config(", "("))
        except PolicyError:
            call = ""
        words = [call, *args.values()]
    else:
        words = [w.rsplit(".", 1)[-1] for w in text.split(":")]
    differs = {k.lower(): v for k, v in DIFFERS.items()}
    said = [differs[w.lower()] for w in words if w.lower() in differs]
    if args.get("backward_override") in _TE_HP_BACKWARD:
        said.append("TransformerEngine runs the backward GEMMs in high precision; castwise rounds them too")
    return "; ".join(said)
