"""Precision settings other tools write as flags or keys, rewritten into castwise's grammar.

Most tools name their precision with one word, which ``castwise.policy.presets`` looks up. Two
write several settings that together make one precision:

- Megatron-LM's command line (bare or as ``megatron:--bf16 ...``): ``--bf16`` / ``--fp16`` (presets
  of the same name), plus ``--fp8-format e4m3|hybrid`` which turns float8 on and ``--fp8-recipe
  delayed|tensorwise|mxfp8|blockwise`` (default ``delayed``; alone it turns nothing on, as in
  Megatron), or ``--fp4-format e2m1`` with ``--fp4-recipe nvfp4`` (the default):
  ``"--bf16 --fp8-format hybrid"`` reads as ``"--bf16,fp8=delayed"``.
- Megatron-Bridge's mixed-precision recipe names (``bf16_with_mxfp8_mixed``, hyphens or
  underscores, bare or as ``megatron-bridge:NAME``, with its ``_bf16_params`` /
  ``_bf16_grad_reduce`` modifiers): ``BRIDGE``. Their first/last layers kept in bf16 are Megatron's
  own layer count, which a policy string cannot name for every model: the recipe reads whole.
- ``nvfp4`` / ``mxfp4`` alone: ``bf16-mixed`` with that 4-bit recipe (as the ``mxfp8`` preset);
  a GEMM recipe named by its tool, as the whole policy: ``te:NVFP4BlockScaling`` (a
  TransformerEngine recipe class) and ``torchao:rowwise`` (a torchao recipe or config name) read as
  ``bf16-mixed`` with that recipe (``castwise.policy.float8.NAMED``), as Accelerate runs both.
- torchtitan's ``[training]`` keys ``mixed_precision_param`` (default bfloat16) and
  ``mixed_precision_reduce`` (default float32): FSDP2's ``MixedPrecisionPolicy`` over float32
  sharded weights, all-gathered and computed in the param dtype, inputs cast, outputs left as
  computed: ``"mixed_precision_param=bfloat16,mixed_precision_reduce=float32"`` reads as
  ``"bf16-mixed,output=bf16"`` (castwise's FSDP2 plan of that policy is torchtitan's).

Torch-free: lint-config can read the same strings.
"""

from __future__ import annotations

from castwise import _dtypes
from castwise.errors import PolicyError
from castwise.policy import float8, presets

__all__ = ["translate"]

_MEGATRON_FLAGS = ("--bf16", "--fp16", "--fp8-format", "--fp8-recipe", "--fp4-format", "--fp4-recipe")
_MEGATRON_VALUES = {
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("delayed", "tensorwise", "mxfp8", "blockwise"),
    "--fp4-format": ("e2m1",),
    "--fp4-recipe": ("nvfp4",),
}
# Megatron-Bridge's recipe names (megatron.bridge.training.mixed_precision, MIXED_PRECISION_RECIPES)
# -> castwise clauses; their base is Megatron's --bf16 / --fp16 (Float16Module, fp32 main params)
_BRIDGE_FP8 = {
    "with_fp8_delayed_scaling": "fp8=delayed",
    "with_mxfp8": "fp8=mxfp8",
    "with_fp8_current_scaling": "fp8=tensorwise:hybrid",
    "with_fp8_subchannel_scaling": "fp8=blockwise:hybrid",
    "with_nvfp4": "fp8=nvfp4",
}
BRIDGE: dict[str, str] = {
    "bf16_mixed": "--bf16",
    "fp16_mixed": "--fp16",
    **{f"{b}_{k}_mixed": f"--{b},{v}" for b in ("bf16", "fp16") for k, v in _BRIDGE_FP8.items() if k != "with_nvfp4"},
    "bf16_with_nvfp4_mixed": "--bf16,fp8=nvfp4",
    "nemotron_h_bf16_with_fp8_current_scaling_mixed": "--bf16,fp8=tensorwise:hybrid",
    "nanov2_bf16_with_fp8_current_scaling_mixed": "--bf16,fp8=blockwise:hybrid",
    "nemotron_3_super_bf16_with_nvfp4_mixed": "--bf16,fp8=nvfp4",
}
# Bridge's name modifiers, in their order: bf16 params change no GEMM; bf16 gradient reduction does
_BRIDGE_MODIFIERS = {"_bf16_params": "", "_bf16_grad_reduce": "reduce=bf16"}
_TORCHTITAN = ("mixed_precision_param", "mixed_precision_reduce")
# torchtitan's param dtype -> the castwise policy FSDP2 runs (no GradScaler in torchtitan)
_TORCHTITAN_BASE = {
    "bfloat16": "bf16-mixed,output=bf16",
    "float16": "16-mixed,output=f16,loss_scale=none",
    "float32": "32-true",
}


def _megatron(head: str) -> str:
    words = head.replace("=", " ").split()
    base, given = "32-true", dict[str, str]()
    i = 0
    while i < len(words):
        flag = words[i].lower()
        if flag in ("--bf16", "--fp16"):
            base = flag
        elif flag in _MEGATRON_VALUES and i + 1 < len(words):
            value, valid = words[i + 1].lower(), _MEGATRON_VALUES[flag]
            if value not in valid:
                raise PolicyError(f"Megatron {flag} {words[i + 1]!r} is not valid; valid: {', '.join(valid)}")
            given[flag] = value
            i += 1
        else:
            raise PolicyError(
                f"Megatron flag {words[i]!r} in {head!r} is not one castwise reads; valid: "
                f"{', '.join(_MEGATRON_FLAGS)} (with "
                + ", ".join(f"{f} {'|'.join(v)}" for f, v in _MEGATRON_VALUES.items())
                + ")"
            )
        i += 1
    return _megatron_recipe(head, base, given)


def _megatron_recipe(head: str, base: str, given: dict[str, str]) -> str:
    fp8 = "--fp8-format" in given or "--fp8-recipe" in given
    fp4 = "--fp4-format" in given or "--fp4-recipe" in given
    if fp8 and fp4:
        raise PolicyError(
            f"{head!r}: Megatron takes float8 or float4 GEMMs, not both; drop the --fp8-* or --fp4-* flags"
        )
    if fp4:
        return f"{base},fp8={given.get('--fp4-recipe', 'nvfp4')}"
    recipe = given.get("--fp8-recipe", "delayed")
    fmt = given.get("--fp8-format")
    if fmt is None:
        if fp8:  # Megatron itself runs no float8 then: args.fp8 stays None
            raise PolicyError(f"{head!r}: Megatron turns float8 on with --fp8-format (e4m3 or hybrid); add it")
        return base
    return f"{base},fp8={recipe}:{fmt}"


def _bridge(name: str) -> str | None:
    """The clauses of a Megatron-Bridge recipe name (its modifiers too); None: not one."""
    key = name.strip().lower().replace("-", "_")
    if key in BRIDGE:
        return BRIDGE[key]
    applied: list[str] = []
    for modifier in reversed(_BRIDGE_MODIFIERS):
        if key.endswith(modifier):
            key = key.removesuffix(modifier)
            applied.insert(0, modifier)
    base = BRIDGE.get(key, BRIDGE.get(f"{key}_mixed")) if applied else None
    if base is None:
        return None
    # an fp16 recipe reduces in fp16 already: only a bf16 one changes
    extra = [_BRIDGE_MODIFIERS[m] for m in applied if _BRIDGE_MODIFIERS[m] and base.startswith("--bf16")]
    return ",".join([base, *extra])


def _torchtitan(clauses: list[str]) -> list[str]:
    given: dict[str, str] = {}
    rest = []
    for clause in clauses:
        key, _, value = clause.partition("=")
        if key.strip().lower() in _TORCHTITAN:
            given[key.strip().lower()] = value.strip()
        else:
            rest.append(clause)
    if rest and "=" not in rest[0]:
        raise PolicyError(
            f"torchtitan's {', '.join(given)} say the whole precision; drop the preset {rest[0]!r} "
            "or the torchtitan keys"
        )
    param = _dtypes.canonical(given.get("mixed_precision_param", "bfloat16"))
    reduce = _dtypes.canonical(given.get("mixed_precision_reduce", "float32"))
    if param not in _TORCHTITAN_BASE or reduce not in ("float32", "bfloat16", "float16"):
        raise PolicyError(
            f"torchtitan mixed_precision_param={given.get('mixed_precision_param', 'bfloat16')!r}, "
            f"mixed_precision_reduce={given.get('mixed_precision_reduce', 'float32')!r} is not valid; "
            "valid: bfloat16, float16 or float32 for each"
        )
    out = _TORCHTITAN_BASE[param].split(",")
    if reduce != "float32":
        out.append(f"reduce={_dtypes.short(reduce)}")
    return out + rest


def _head(head: str) -> str | None:
    """A whole-policy name another tool writes, as castwise clauses; None: not one."""
    text = head.strip()
    if text.lower().startswith("megatron:") and text[len("megatron:") :].lstrip().startswith("--"):
        text = text[len("megatron:") :].lstrip()
    if text.startswith("--"):
        return _megatron(text)
    prefix, colon, name = text.partition(":")
    if colon and prefix.strip().lower() in ("megatron-bridge", "megatron_bridge"):
        found = _bridge(name)
        if found is None:
            raise PolicyError(f"unknown Megatron-Bridge recipe {name.strip()!r}; valid: {', '.join(sorted(BRIDGE))}")
        return found
    recipe = float8.named(text) or (text.lower() if text.lower() in float8.FP4 else None)
    if recipe is not None:  # a recipe alone (nvfp4, mxfp4, te:CLASS) over bf16 autocast, as mxfp8
        return f"bf16-mixed,fp8={recipe}"
    if colon or text in presets.PRESETS or text.lower() in presets.PRESETS:
        return None  # Lightning's bf16-mixed stays Lightning's (Bridge registers the hyphenated name too)
    return _bridge(text)


def translate(clauses: list[str]) -> list[str]:
    """``clauses`` (a split policy string) with other tools' names, Megatron flags and torchtitan
    keys rewritten."""
    head = _head(clauses[0]) if clauses else None
    if head is not None:
        clauses = [*head.split(","), *clauses[1:]]
    if any(c.partition("=")[0].strip().lower() in _TORCHTITAN for c in clauses):
        clauses = _torchtitan(clauses)
    return clauses
