"""The float8 part of ``castwise.export``: a policy's ``fp8=`` recipe as each library's settings.

- Accelerate: ``mixed_precision: fp8`` (bf16 autocast around float8 GEMMs) and its ``fp8_config``:
  ``backend: AO`` (torchao) for tensorwise and rowwise scaling, ``backend: TE``
  (TransformerEngine) for delayed scaling and MXFP8, with the keys ``accelerate launch`` turns
  into the ``ACCELERATE_FP8_*`` variables its recipe kwargs read (``fp8_format``,
  ``amax_history_len``, ``amax_compute_algo``, ``margin``, ``interval``,
  ``override_linear_precision``, ``use_autocast_during_eval``, ``use_mxfp8_block_scaling``;
  ``enable_fsdp_float8_all_gather``, ``pad_inner_dim`` for AO).
- Lightning: ``precision="transformer-engine"`` (bf16 weights, TE's ``DelayedScaling`` HYBRID) or
  ``"transformer-engine-float16"``; torchao recipes have no Lightning precision.
- torchtitan: ``[model] converters = ["quantize.linear.float8"]`` with ``[quantize.linear.float8]``
  (``recipe_name``, ``filter_fqns``, FSDP2 float8 all-gather for tensorwise), or
  ``quantize.linear.mx`` (``recipe_name = "mxfp8_cublas"``) for mxfp8.

Each function returns the settings and the parts the target cannot say (for ExportWarning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from castwise._dtypes import is_low, name_of, short_of

if TYPE_CHECKING:
    from castwise.policy import Policy

_TE_FORMAT = {"hybrid": "HYBRID", "e4m3": "E4M3", "e5m2": "E5M2"}
_TITAN_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _base_is(p: Policy, text: str) -> bool:
    from castwise.policy import Policy

    return p.replace(float8=None, rules=()) == Policy.parse(text).replace(float8=None)


def accelerate(p: Policy, fsdp: bool) -> tuple[dict[str, Any] | None, list[str]]:
    """``fp8_config`` for ``p``'s recipe (None: Accelerate has none for it), and what Accelerate
    cannot say of it."""
    recipe = p.float8
    assert recipe is not None
    left: list[str] = []
    if recipe.fp4:  # Accelerate's fp8_config has no 4-bit recipe: the base trains, the GEMMs stay bf16
        return None, [f"fp8={recipe} (Accelerate has no 4-bit recipe: convert the Linears in the script)"]
    if not _base_is(p, "bf16-mixed"):
        left.append(f"the base precision {p.replace(float8=None, rules=())} (Accelerate's fp8 runs bf16 autocast)")
    if recipe.scaling in ("tensorwise", "rowwise"):
        config: dict[str, Any] = {"backend": "AO", "enable_fsdp_float8_all_gather": fsdp, "pad_inner_dim": False}
        if recipe.scaling == "rowwise":
            config["enable_fsdp_float8_all_gather"] = False  # torchao all-gathers tensorwise scales only
            left.append(
                "fp8=rowwise (Accelerate's AO backend reads no recipe: pass AORecipeKwargs(config="
                "Float8LinearConfig.from_recipe_name('rowwise')) to the Accelerator)"
            )
        if recipe.format == "e5m2":
            left.append("fp8 format e5m2 (Accelerate's AO backend casts inputs and weights to e4m3)")
        return config, left
    if recipe.scaling == "blockwise":
        left.append("fp8=blockwise (Accelerate's TE backend has no block scaling setting)")
    config = {
        "backend": "TE",
        "fp8_format": _TE_FORMAT[str(recipe.format)],
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
        "margin": 0,
        "interval": 1,
        "override_linear_precision": [False, False, False],
        "use_autocast_during_eval": False,
    }
    if recipe.scaling == "mxfp8":
        config["use_mxfp8_block_scaling"] = True
    return config, left


def lightning(p: Policy, base_precision: str) -> tuple[str, list[str], bool]:
    """Lightning's precision for ``p``, what it cannot say, and whether the base is Lightning's own
    (then the base's default dtype is said by the precision too)."""
    import torch

    recipe = p.float8
    assert recipe is not None
    if recipe.scaling != "delayed" or not is_low(p.compute_dtype):
        return (
            base_precision,
            [
                f"fp8={recipe} (Lightning's float8 precision is TransformerEngine's delayed scaling: convert "
                "the Linears in configure_model with castwise.apply(model, policy) or torchao's "
                "convert_to_float8_training)"
            ],
            False,
        )
    precision = "transformer-engine" if p.compute_dtype == torch.bfloat16 else "transformer-engine-float16"
    left = []
    own = _base_is(p, precision)
    if not own:
        left.append(
            f"the base precision {p.replace(float8=None, rules=())} (Lightning's {precision} stores "
            f"{short_of(p.compute_dtype)} weights and sets the default dtype)"
        )
    if recipe.format != "hybrid":
        te = _TE_FORMAT[str(recipe.format)]
        left.append(
            f"fp8 format {recipe.format} ({precision} runs DelayedScaling's HYBRID: use plugins="
            f"TransformerEnginePrecision(weights_dtype=..., recipe={{'fp8_format': '{te}'}}))"
        )
    return precision, left, own


def _filter_fqns(p: Policy, model: Any) -> list[str]:
    if model is not None:
        from castwise.applied.inspection import resolve
        from castwise.float8.convert import plan

        assert p.float8 is not None
        return sorted(name for name, _ in plan(model, p.float8, resolve(p, model)).left_out)
    names = ["output"]  # torchtitan's default: the output projection stays high precision
    names += [str(r.selector) for r in p.rules if r.kind == "keep" and isinstance(r.selector, str)]
    return names


def torchtitan(p: Policy, model: Any, fsdp: bool) -> tuple[dict[str, Any], list[str]]:
    """A torchtitan job TOML's sections for ``p``, and what it cannot say."""

    left: list[str] = []
    param = name_of(p.compute_dtype)
    if not p.is_mixed and param != "float32":
        left.append(f"{short_of(p.param_dtype)} weights (torchtitan keeps float32 sharded weights; FSDP2 gathers them)")
    out: dict[str, Any] = {
        "training": {"mixed_precision_param": param, "mixed_precision_reduce": name_of(p.reduce_dtype)}
    }
    recipe = p.float8
    if recipe is None:
        out["model"] = {"converters": []}
        return out, left
    fqns = _filter_fqns(p, model)
    if recipe.scaling in ("mxfp8", "mxfp4"):
        name = "mxfp8_cublas" if recipe.scaling == "mxfp8" else "mxfp4_cutlass"  # torchao's MX recipe names
        out["model"] = {"converters": ["quantize.linear.mx"]}
        out["quantize"] = {"linear": {"mx": {"recipe_name": name, "filter_fqns": fqns}}}
        return out, left
    if recipe.scaling not in ("tensorwise", "rowwise"):
        left.append(
            f"fp8={recipe} (torchtitan's float8 converter scales tensorwise or rowwise; its MX one mxfp8, mxfp4)"
        )
        out["model"] = {"converters": []}
        return out, left
    section: dict[str, Any] = {"filter_fqns": fqns}
    if recipe.scaling == "rowwise":
        section["recipe_name"] = "rowwise"  # torchtitan refuses rowwise with float8 all-gather
    elif fsdp:
        section |= {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True}
    if recipe.format == "e5m2":
        left.append("fp8 format e5m2 (torchtitan's float8 recipes cast inputs and weights to e4m3)")
    out["model"] = {"converters": ["quantize.linear.float8"]}
    out["quantize"] = {"linear": {"float8": section}}
    return out, left
