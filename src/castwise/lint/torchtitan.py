"""torchtitan job configs (TOML): FSDP2 mixed precision and the float8 / MX model converters.

Semantics (pytorch/torchtitan, torchtitan/config/job_config.py and
torchtitan/components/quantization/):
- ``[training] mixed_precision_param`` (default bfloat16) and ``mixed_precision_reduce``
  (default float32): FSDP2's ``MixedPrecisionPolicy`` over float32 sharded weights (castwise's
  ``mixed_precision_param=...`` policy strings, castwise.policy.vocab); no GradScaler.
- ``[model] converters``: ``"quantize.linear.float8"`` (older releases: ``"float8"``) swaps Linears
  for torchao's Float8Linear with the settings of ``[quantize.linear.float8]`` (older:
  ``[float8]``): ``recipe_name`` (none: tensorwise; ``tensorwise``, ``rowwise``,
  ``rowwise_with_gw_hp``), ``enable_fsdp_float8_all_gather``,
  ``precompute_float8_dynamic_scale_for_fsdp``, ``filter_fqns``, ``emulate``.
  ``"quantize.linear.mx"`` (older: ``"mx"``) does MXFP8 with ``[quantize.linear.mx]``
  (``recipe_name``: ``mxfp8_cublas``...). A section whose converter is not listed is never read.
- Float8 all-gather works with tensorwise scaling only: torchtitan refuses ``recipe_name`` with
  ``enable_fsdp_float8_all_gather``; precomputed scales only take effect with the all-gather.
"""

from __future__ import annotations

import re
from typing import Any

from castwise.errors import PolicyError
from castwise.lint._source import Document, Path_
from castwise.lint.model import ConfigFile, Setting, Traced, dtype_of, is_scalar
from castwise.policy import toolnames
from castwise.policy.float8 import Float8Recipe

__all__ = ["FLOAT8_SECTIONS", "GROUPED_SECTIONS", "MX_SECTIONS", "is_torchtitan", "read"]

FLOAT8_SECTIONS: dict[str, tuple[str, ...]] = {
    "quantize.linear.float8": ("quantize", "linear", "float8"),
    "float8": ("float8",),
}
MX_SECTIONS: dict[str, tuple[str, ...]] = {
    "quantize.linear.mx": ("quantize", "linear", "mx"),
    "mx": ("mx",),
}
# the MoE converters' sections: they convert grouped GEMMs, not the Linears (no CW214 with a Linear one)
GROUPED_SECTIONS: dict[str, tuple[str, ...]] = {
    "quantize.grouped_mm.float8": ("quantize", "grouped_mm", "float8"),
    "quantize.grouped_mm.mx": ("quantize", "grouped_mm", "mx"),
}
_SECTION = re.compile(r"\s*\[\s*([A-Za-z0-9_.\-]+)\s*\]")
_KEY = re.compile(r"\s*([A-Za-z0-9_\-]+)\s*=")


def is_torchtitan(data: dict[str, Any]) -> bool:
    training = data.get("training")
    model = data.get("model")
    return (
        (isinstance(training, dict) and any(k.startswith("mixed_precision_") for k in training))
        or (isinstance(model, dict) and "converters" in model)
        or "job" in data
        or "quantize" in data
    )


def _lines(text: str) -> dict[Path_, int]:
    """The line of every ``[section]`` and ``key =`` under it (tomllib keeps no positions)."""
    out: dict[Path_, int] = {}
    section: tuple[str, ...] = ()
    for number, raw in enumerate(text.splitlines(), 1):
        head = _SECTION.match(raw)
        if head:
            section = tuple(head.group(1).split("."))
            out.setdefault(section, number)
            continue
        key = _KEY.match(raw)
        if key:
            out.setdefault((*section, key.group(1)), number)
    return out


def read(doc: Document, text: str, shown: str) -> ConfigFile:
    """A torchtitan TOML's precision settings, keyed by their dotted TOML names."""
    lines = _lines(text)
    doc = Document(doc.data, {**doc.lines, **lines})
    settings: dict[str, Setting] = {}
    rejected: dict[str, Setting] = {}

    def put(path: tuple[str, ...], value: Any) -> None:
        key = ".".join(path)
        s = Setting(key, value, shown, doc.line(path))
        if is_scalar(value) or isinstance(value, list):
            settings[key] = s
        else:
            rejected[key] = s

    for key in ("dtype", "mixed_precision_param", "mixed_precision_reduce"):
        value = doc.at(("training", key))
        if value is not None:
            put(("training", key), value)
    converters = doc.at(("model", "converters"))
    if converters is not None:
        put(("model", "converters"), converters)
    for sections in (FLOAT8_SECTIONS, MX_SECTIONS, GROUPED_SECTIONS):
        for path in sections.values():
            block = doc.at(path)
            if isinstance(block, dict):
                settings[".".join(path) + ".block"] = Setting(".".join(path), "{...}", shown, doc.line(path))
                for k, v in block.items():
                    put((*path, k), v)
    return ConfigFile(shown, "torchtitan", settings, rejected=rejected)


def converters(cf: ConfigFile) -> list[str]:
    value = cf.value("model.converters")
    if isinstance(value, str):
        return [c.strip() for c in value.split(",") if c.strip()]
    return [str(c) for c in value] if isinstance(value, list) else []


_SCHEME = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def contribute(cf: ConfigFile, put: Any) -> None:
    param = cf.get("training.mixed_precision_param")
    reduce = cf.get("training.mixed_precision_reduce")
    compute = dtype_of(param.value) if param is not None else "bfloat16"
    note = "torchtitan's FSDP2 MixedPrecisionPolicy(param_dtype=mixed_precision_param) over float32 weights"
    put("compute", Traced(compute or "bfloat16", (param,) if param is not None else (), note))
    conv = cf.get("model.converters")
    linear = [c for c in converters(cf) if c in FLOAT8_SECTIONS or c in MX_SECTIONS]
    if conv is not None and linear:
        # the converted Linears' GEMMs take the recipe's inputs (float8_e4m3fn; E2M1 for mxfp4)
        path = {**FLOAT8_SECTIONS, **MX_SECTIONS}[linear[0]]
        recipe = cf.get(".".join(path) + ".recipe_name")
        try:
            value = toolnames.named(f"torchtitan:{linear[0]}:{recipe.value if recipe is not None else ''}")
        except PolicyError:
            value = None  # a recipe torchtitan refuses (CW214)
        dtype = Float8Recipe.parse(value).forward_dtype if value else "float8_e4m3fn"
        note = f"torchtitan's {linear[0]} converter: Linears compute in {dtype}, the rest in the param dtype"
        put("compute", Traced(dtype, (conv,) + ((recipe,) if recipe is not None else ()), note))
    # torchtitan/train.py Trainer.__init__ builds the model under
    # ``set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype])`` (default float32): the
    # parameters, hence their gradients and torch.optim's ``zeros_like(p)`` state, are in that dtype
    given = cf.get("training.dtype")
    stored = (dtype_of(given.value) if given is not None else None) or "float32"
    src = (given,) if given is not None else ()
    weak = given is None
    put("weights", Traced(stored, src, "training.dtype: the dtype the model's parameters are built in"), weak=weak)
    put("gradients", Traced(stored, src, "FSDP2 keeps sharded gradients in the weights' dtype"), weak=weak)
    put("optimizer_state", Traced(stored, src, "torch.optim state follows the parameters' dtype"), weak=weak)
    put("state_scheme", Traced(_SCHEME.get(stored, "unknown"), src, "torch.optim AdamW"), weak=weak)
    put("master", Traced("none", src, "no separate master copy: the sharded parameters are updated"), weak=weak)
    put("rounding", Traced("none", src, "torch.optim rounds to nearest"), weak=weak)
    put("loss_scaling", Traced("none", (), "torchtitan has no GradScaler"), weak=True)
    red = dtype_of(reduce.value) if reduce is not None else "float32"
    put("reduce", Traced(red or "float32", (reduce,) if reduce is not None else (), "reduce_dtype"))
