"""Precision settings other tools write as flags or keys, rewritten into castwise's grammar.

Most tools name their precision with one word, which ``castwise.policy.presets`` looks up. Two
write several settings that together make one precision:

- Megatron-LM's command line (bare or as ``megatron:--bf16 ...``): ``--bf16`` / ``--fp16`` (presets
  of the same name), plus ``--fp8-format e4m3|hybrid`` which turns float8 on and ``--fp8-recipe
  delayed|tensorwise|mxfp8|blockwise`` (default ``delayed``), or ``--fp4-format e2m1`` with
  ``--fp4-recipe nvfp4`` (the default): ``"--bf16 --fp8-format hybrid"`` reads as
  ``"--bf16,fp8=delayed"``. Without a format Megatron runs no low-precision GEMMs, so a recipe flag
  alone reads as the base and ``notes`` says it is inert; the other fp8/fp4 flags are read
  (``MEGATRON_VALUES``, ``MEGATRON_SWITCHES``) and ``notes`` says where castwise rounds a GEMM
  Megatron keeps in bf16.
- Megatron-Bridge's mixed-precision recipe names (``bf16_with_mxfp8_mixed``, hyphens or
  underscores, bare or as ``megatron-bridge:NAME``, with its ``_bf16_params`` /
  ``_bf16_grad_reduce`` modifiers): ``BRIDGE``. Their first/last layers kept in bf16 are Megatron's
  own layer count, which a policy string cannot name for every model: the recipe reads whole.
- ``nvfp4`` / ``mxfp4`` alone: ``bf16-mixed`` with that 4-bit recipe (as the ``mxfp8`` preset);
  a GEMM recipe named by its tool, as the whole policy: ``te:NVFP4BlockScaling`` (a
  TransformerEngine recipe class) and ``torchao:rowwise`` (a torchao recipe or config name) read as
  ``bf16-mixed`` with that recipe (``castwise.policy.toolnames``), as Accelerate runs both.
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
from castwise.policy import float8, presets, toolnames

__all__ = ["MEGATRON_OLD_FORMATS", "MEGATRON_SWITCHES", "MEGATRON_VALUES", "notes", "translate"]

# NVIDIA/Megatron-LM megatron/core/transformer/transformer_config.py (TransformerConfig's fp8/fp4
# fields, their flags made by megatron/training/argument_utils.py: --FIELD, --no-FIELD for a True
# default) and megatron/training/arguments.py (_add_transformer_engine_args, _add_mixed_precision_args)
MEGATRON_VALUES: dict[str, tuple[str, ...] | None] = {  # None: any value (a count, an import path)
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("delayed", "tensorwise", "mxfp8", "blockwise", "custom"),
    "--fp4-format": ("e2m1",),
    "--fp4-recipe": ("nvfp4", "custom"),
    "--fp8-amax-compute-algo": ("most_recent", "max"),
    "--fp8-margin": None,
    "--fp8-interval": None,
    "--fp8-amax-history-len": None,
    "--num-layers-at-start-in-bf16": None,
    "--num-layers-at-end-in-bf16": None,
    "--fp8-quantizer-factory": None,
    "--fp4-quantizer-factory": None,
}
# switches that change no GEMM's operand format castwise models (where they do, _megatron_notes says)
MEGATRON_SWITCHES = (
    "--fp8-param",
    "--fp8-param-gather",
    "--fp4-param-gather",
    "--fp8-output-proj",
    "--fp8-dot-product-attention",
    "--fp8-multi-head-attention",
    "--reuse-grad-buf-for-mxfp8-param-ag",
    "--no-fp8-wgrad",
    "--disable-fp8-wgrad",
    "--first-last-layers-bf16",
    "--grad-reduce-in-bf16",
    "--accumulate-allreduce-grads-in-fp32",
)
# Megatron-LM before 2023-08 (megatron/arguments.py, replaced by --fp8-format in 1b7a3836): a
# switch per format, refused together ("cannot train with both fp8 e4m3 and hybrid formatting")
MEGATRON_OLD_FORMATS = {"--fp8-e4m3": "e4m3", "--fp8-hybrid": "hybrid"}
_MEGATRON_FLAGS = ("--bf16", "--fp16", *MEGATRON_VALUES, *MEGATRON_SWITCHES, *MEGATRON_OLD_FORMATS)
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
# the recipes that set first_last_layers_bf16 (same file): (layers at the start, at the end) in bf16
BRIDGE_BF16_LAYERS: dict[str, tuple[int, int]] = {
    **{f"{b}_with_fp8_current_scaling_mixed": (1, 1) for b in ("bf16", "fp16")},
    "nemotron_h_bf16_with_fp8_current_scaling_mixed": (2, 2),
    "nanov2_bf16_with_fp8_current_scaling_mixed": (2, 2),
    "nemotron_3_super_bf16_with_nvfp4_mixed": (0, 14),
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


def _megatron_words(head: str) -> tuple[str, dict[str, str], set[str]]:
    """(base preset, valued flags, switches) of a Megatron command line."""
    words = head.replace("=", " ").split()
    base, given, switches = "32-true", dict[str, str](), set[str]()
    i = 0
    while i < len(words):
        flag = words[i].lower()
        if flag in ("--bf16", "--fp16"):
            base = flag
        elif flag in MEGATRON_SWITCHES:
            switches.add(flag)
        elif flag in MEGATRON_OLD_FORMATS:
            if given.get("--fp8-format", MEGATRON_OLD_FORMATS[flag]) != MEGATRON_OLD_FORMATS[flag]:
                raise PolicyError(f"{head!r}: Megatron refuses --fp8-e4m3 with --fp8-hybrid; keep one")
            given["--fp8-format"] = MEGATRON_OLD_FORMATS[flag]
        elif flag in MEGATRON_VALUES and i + 1 < len(words):
            value, valid = words[i + 1].lower(), MEGATRON_VALUES[flag]
            if valid is not None and value not in valid:
                raise PolicyError(f"Megatron {flag} {words[i + 1]!r} is not valid; valid: {', '.join(valid)}")
            given[flag] = value
            i += 1
        else:
            raise PolicyError(
                f"Megatron flag {words[i]!r} in {head!r} is not one castwise reads; valid: "
                + ", ".join(("--bf16", "--fp16", *MEGATRON_SWITCHES, *MEGATRON_OLD_FORMATS))
                + ", "
                + ", ".join(f"{f} {'|'.join(v)}" for f, v in MEGATRON_VALUES.items() if v)
                + f", {', '.join(f for f, v in MEGATRON_VALUES.items() if v is None)} (with a value)"
            )
        i += 1
    return base, given, switches


def _megatron(head: str) -> str:
    base, given, switches = _megatron_words(head)
    fp8, fp4 = given.get("--fp8-format"), given.get("--fp4-format")
    if fp8 and fp4:  # arguments.py validate_args
        raise PolicyError(
            f"{head!r}: Megatron refuses --fp4-format with --fp8-format ('cannot be used simultaneously'); drop one"
        )
    recipe = given.get("--fp4-recipe", "nvfp4") if fp4 else given.get("--fp8-recipe", "delayed")
    if (fp8 or fp4) and recipe == "custom":
        raise PolicyError(
            f"{head!r}: a custom recipe quantizes through --fp8/--fp4-quantizer-factory, which castwise "
            "cannot read; name the built-in recipe it follows (--fp8-recipe delayed|tensorwise|mxfp8|blockwise)"
        )
    if fp8 and recipe == "delayed" and "--first-last-layers-bf16" in switches:  # TransformerConfig.__post_init__
        raise PolicyError(f"{head!r}: Megatron refuses --first-last-layers-bf16 with delayed scaling; drop one")
    out = [base]
    if "--grad-reduce-in-bf16" in switches and base == "--bf16":
        out.append("reduce=bf16")
    if "--accumulate-allreduce-grads-in-fp32" in switches and base == "--fp16":
        out.append("reduce=f32")
    if fp4:
        out.append(f"fp8={recipe}")
    elif fp8:  # without --fp8-format Megatron runs no float8 (args.fp8 None): the recipe is inert
        out.append(f"fp8={recipe}:{fp8}")
    return ",".join(out)


def _megatron_notes(head: str) -> list[str]:
    _, given, switches = _megatron_words(head)
    fp8, fp4 = "--fp8-format" in given, "--fp4-format" in given
    notes = []
    for flag in sorted({*given, *switches}):
        if not flag.startswith(("--fp8", "--fp4", "--first", "--num-layers", "--no-fp8", "--disable-fp8", "--reuse")):
            continue
        needs = "--fp4-format" if flag.startswith("--fp4") else "--fp8-format"
        on = fp4 if flag.startswith("--fp4") else fp8 or fp4
        if not on and flag not in ("--fp8-format", "--fp4-format"):
            notes.append(f"{flag} is inert: Megatron runs no low-precision GEMMs without {needs}")
    if (fp8 or fp4) and "--first-last-layers-bf16" in switches:
        notes.append(
            "--first-last-layers-bf16: Megatron keeps the first/last layers' GEMMs in bf16 "
            "(castwise's fp8= converts every Linear: add keep rules for those layers)"
        )
    if fp8 and switches & {"--no-fp8-wgrad", "--disable-fp8-wgrad"}:
        notes.append("--no-fp8-wgrad: Megatron computes weight gradients in high precision; castwise rounds them")
    return notes


def notes(text: str) -> tuple[str, ...]:
    """What a tool's precision string says that castwise reads as inert or cannot express (a
    Megatron --fp8-recipe without --fp8-format, a recipe's high-precision backward...); () when
    nothing. PolicyError as ``translate`` for a string it refuses."""
    head = text.split(",", 1)[0].strip() if not text.strip().startswith(("te:", "torchao:", "torchtitan:")) else text
    if head.lower().startswith("megatron:"):
        head = head[len("megatron:") :].strip()
    if head.startswith("--"):
        return tuple(_megatron_notes(head))
    bridge = head.lower().removeprefix("megatron-bridge:").removeprefix("megatron_bridge:").strip()
    for name, (start, end) in BRIDGE_BF16_LAYERS.items():
        if bridge.replace("-", "_").startswith(name):
            return (
                f"{name} keeps the first {start} and last {end} transformer layers' GEMMs in bf16 "
                "(castwise's fp8= converts every Linear: add keep rules for those layers)",
            )
    said = toolnames.note(text.strip())
    return (said,) if said else ()


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


def _head(head: str) -> list[str] | None:
    """A whole-policy name another tool writes, as castwise clauses; None: not one."""
    text = head.strip()
    if text.lower().startswith("megatron:") and text[len("megatron:") :].lstrip().startswith("--"):
        text = text[len("megatron:") :].lstrip()
    if text.startswith("--"):
        return _megatron(text).split(",")
    prefix, colon, name = text.partition(":")
    if colon and prefix.strip().lower() in ("megatron-bridge", "megatron_bridge"):
        found = _bridge(name)
        if found is None:
            raise PolicyError(f"unknown Megatron-Bridge recipe {name.strip()!r}; valid: {', '.join(sorted(BRIDGE))}")
        return found.split(",")
    if float8.named(text) is not None:  # a tool's recipe alone (te:CLASS(...), torchao:NAME) over bf16 autocast
        return ["bf16-mixed", f"fp8={text}"]  # the recipe keeps its name: its note says how castwise differs
    if text.lower() in float8.FP4:  # nvfp4, mxfp4 alone, as the mxfp8 preset
        return ["bf16-mixed", f"fp8={text.lower()}"]
    if colon or text in presets.PRESETS or text.lower() in presets.PRESETS:
        return None  # Lightning's bf16-mixed stays Lightning's (Bridge registers the hyphenated name too)
    found = _bridge(text)
    return found.split(",") if found is not None else None


def translate(clauses: list[str]) -> list[str]:
    """``clauses`` (a split policy string) with other tools' names, Megatron flags and torchtitan
    keys rewritten."""
    head = _head(clauses[0]) if clauses else None
    if head is not None:
        clauses = [*head, *clauses[1:]]
    if any(c.partition("=")[0].strip().lower() in _TORCHTITAN for c in clauses):
        clauses = _torchtitan(clauses)
    return clauses
