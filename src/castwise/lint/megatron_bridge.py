"""Megatron-Bridge config YAML (``ConfigContainer.to_yaml()``, an override file): ``mixed_precision``.

Semantics (NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/training/mixed_precision.py):
``mixed_precision`` is a name of ``MIXED_PRECISION_RECIPES`` (``bf16_with_mxfp8_mixed``, each also
hyphenated; ``get_mixed_precision_config`` raises for any other) or a ``MixedPrecisionConfig``
mapping whose fields are Megatron's own (``bf16``, ``fp8`` = ``--fp8-format``, ``fp8_recipe``,
``fp4``, ``fp4_recipe``, ``grad_reduce_in_fp32``, ``first_last_layers_bf16``...), applied to the model,
optimizer and DDP configs. Both read as the Megatron command line ``castwise.policy.vocab`` reads, so
``castwise.lint.megatron`` contributes their precision and an fp8 recipe without a format is CW213.
"""

from __future__ import annotations

from typing import Any

from castwise.lint._source import Document
from castwise.lint.model import ConfigFile, Setting, is_scalar, is_true
from castwise.policy import vocab

__all__ = ["is_megatron_bridge", "megatron_view", "read"]

# ConfigContainer's groups (docs/megatron-lm-to-megatron-bridge.md): a mapping with mixed_precision
# and two of these is a Bridge config
_GROUPS = ("model", "train", "optimizer", "ddp", "scheduler", "dataset", "checkpoint", "dist", "comm_overlap", "rng")
# MixedPrecisionConfig field -> the Megatron flag it sets (valued ones keep their value)
_FIELDS: dict[str, str] = {
    "bf16": "--bf16",
    "fp16": "--fp16",
    "fp8": "--fp8-format",
    "fp8_recipe": "--fp8-recipe",
    "fp4": "--fp4-format",
    "fp4_recipe": "--fp4-recipe",
    "fp8_param_gather": "--fp8-param-gather",
    "fp4_param_gather": "--fp4-param-gather",
    "fp8_param": "--fp8-param",
    "first_last_layers_bf16": "--first-last-layers-bf16",
    "num_layers_at_start_in_bf16": "--num-layers-at-start-in-bf16",
    "num_layers_at_end_in_bf16": "--num-layers-at-end-in-bf16",
    "fp8_margin": "--fp8-margin",
    "fp8_amax_history_len": "--fp8-amax-history-len",
    "fp8_amax_compute_algo": "--fp8-amax-compute-algo",
    "fp8_dot_product_attention": "--fp8-dot-product-attention",
    "fp8_multi_head_attention": "--fp8-multi-head-attention",
    "reuse_grad_buf_for_mxfp8_param_ag": "--reuse-grad-buf-for-mxfp8-param-ag",
}


def is_megatron_bridge(data: dict[str, Any]) -> bool:
    mp = data.get("mixed_precision")
    return mp is not None and sum(g in data for g in _GROUPS) >= 2


def read(doc: Document, shown: str) -> ConfigFile:
    settings: dict[str, Setting] = {}
    mp = doc.at(("mixed_precision",))
    if isinstance(mp, dict):
        for key, value in mp.items():
            if is_scalar(value):
                settings[f"mixed_precision.{key}"] = Setting(
                    f"mixed_precision.{key}", value, shown, doc.line(("mixed_precision", key))
                )
    elif mp is not None:
        settings["mixed_precision"] = Setting("mixed_precision", mp, shown, doc.line(("mixed_precision",)))
    return ConfigFile(shown, "megatron-bridge", settings)


def _recipe_flags(s: Setting) -> dict[str, Setting]:
    """A recipe name's Megatron flags, each standing on the ``mixed_precision`` setting."""
    clauses = vocab.BRIDGE.get(str(s.value).strip().lower().replace("-", "_"))
    if clauses is None:
        return {}  # not a Bridge recipe: CW220 says so
    flags = {clauses.split(",")[0]: s}
    for clause in clauses.split(",")[1:]:
        scaling, _, fmt = clause.removeprefix("fp8=").partition(":")
        if scaling == "nvfp4":
            flags |= {"--fp4-format": _as(s, "e2m1"), "--fp4-recipe": _as(s, "nvfp4")}
        else:
            flags |= {"--fp8-format": _as(s, fmt or "hybrid"), "--fp8-recipe": _as(s, scaling)}
    if str(s.value).replace("-", "_").lower() in vocab.BRIDGE_BF16_LAYERS:
        flags["--first-last-layers-bf16"] = _as(s, True)
    return flags


def _as(s: Setting, value: Any) -> Setting:
    return Setting(s.name, value, s.file, s.line)


def megatron_view(cf: ConfigFile) -> ConfigFile:
    """The file as the Megatron command line it configures (settings keyed by flag, each still
    named and placed as the YAML writes it)."""
    flags: dict[str, Setting] = {}
    recipe = cf.get("mixed_precision")
    if recipe is not None:
        flags = _recipe_flags(recipe)
    for key, s in cf.settings.items():
        field = key.removeprefix("mixed_precision.")
        flag = _FIELDS.get(field)
        if flag is None or s.value is None or (flag in vocab.MEGATRON_SWITCHES and not is_true(s.value)):
            continue
        if flag in ("--bf16", "--fp16") and not is_true(s.value):
            continue
        flags[flag] = s
    reduce = cf.get("mixed_precision.grad_reduce_in_fp32")
    if reduce is not None and not is_true(reduce.value) and "--bf16" in flags:
        flags["--grad-reduce-in-bf16"] = reduce
    return ConfigFile(cf.path, "megatron", flags)
