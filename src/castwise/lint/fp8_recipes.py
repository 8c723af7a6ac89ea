"""CW213 / CW214: float8 recipe settings no code reads, and ones that cannot go together (torch-free).

Accelerate (accelerate/commands/launch.py, utils/launch.py ``setup_fp8_env``, utils/dataclasses.py
``TERecipeKwargs`` / ``AORecipeKwargs``): ``accelerate launch`` turns each ``fp8_config`` key K into
``ACCELERATE_FP8_K`` (``fp8_format`` stays ``ACCELERATE_FP8_FORMAT``); the recipe kwargs read
``FORMAT``, ``AMAX_HISTORY_LEN``, ``AMAX_COMPUTE_ALGO``, ``MARGIN``, ``INTERVAL``, ``OVERRIDE_*``,
``USE_AUTOCAST_DURING_EVAL``, ``USE_MXFP8_BLOCK_SCALING`` (TransformerEngine) and
``ENABLE_FSDP_FLOAT8_ALL_GATHER``, ``PAD_INNER_DIM`` (torchao). ``accelerate config`` itself writes
``amax_history_length`` and ``amax_compute_algorithm`` (accelerate 1.15), which become variables
nothing reads: the recipe runs with its defaults. A key of the other backend is not read either,
and ``fp8_config`` as a whole only with ``mixed_precision: fp8``.

Lightning (lightning/fabric/plugins/precision/transformer_engine.py): ``TransformerEnginePrecision(
recipe={...})`` builds ``DelayedScaling(**recipe)`` after ``recipe["fp8_format"] =
getattr(Format, recipe["fp8_format"])``: a key DelayedScaling does not take raises TypeError, a
format other than ``HYBRID``/``E4M3``/``E5M2`` (the enum's names: case matters) AttributeError,
when the Trainer is built.

torchtitan: see castwise.lint.torchtitan.

Megatron-LM (megatron/training/arguments.py, megatron/core/fp8_utils.py): ``args.fp8`` /
``args.fp4`` come from ``--fp8-format`` / ``--fp4-format`` alone; without them no recipe is built,
so ``--fp8-recipe``, ``--fp8-param-gather``... are never read (``castwise.policy.vocab.notes``).
"""

from __future__ import annotations

from collections.abc import Sequence

from castwise.errors import PolicyError
from castwise.lint import megatron, megatron_bridge, torchtitan
from castwise.lint.model import ConfigFile, Setting, finding, is_true, said
from castwise.policy import vocab
from castwise.report import Finding

__all__ = ["run_checks"]

TE_KEYS = frozenset(
    {
        "fp8_format",
        "amax_history_len",
        "amax_compute_algo",
        "margin",
        "interval",
        "override_linear_precision",
        "use_autocast_during_eval",
        "use_mxfp8_block_scaling",
    }
)
AO_KEYS = frozenset({"enable_fsdp_float8_all_gather", "pad_inner_dim"})
# what `accelerate config` writes -> what the recipe kwargs read
# transformer_engine.common.recipe.DelayedScaling's fields (TransformerEngine 1.x-2.x)
DELAYED_SCALING = frozenset(
    {
        "margin",
        "interval",
        "fp8_format",
        "amax_history_len",
        "amax_compute_algo",
        "override_linear_precision",
        "scaling_factor_compute_algo",
        "reduce_amax",
        "fp8_dpa",
        "fp8_mha",
    }
)
TE_FORMATS = ("HYBRID", "E4M3", "E5M2")
RENAMED = {"amax_history_length": "amax_history_len", "amax_compute_algorithm": "amax_compute_algo"}


def _ignored(s: Setting, why: str, fix: str, *more: Setting) -> Finding:
    return finding("CW213", (s, *more), f"{said((s,))} is never read: {why}.", fix)


def _accelerate(cf: ConfigFile) -> list[Finding]:
    fp8 = {k.split(".", 1)[1]: s for k, s in cf.settings.items() if k.startswith("fp8_config.")}
    if not fp8:
        return []
    mp = cf.get("mixed_precision")
    if mp is None or str(mp.value).lower() != "fp8":
        first = next(iter(fp8.values()))
        said = f"mixed_precision is {mp.text}" if mp is not None else "mixed_precision is not set"
        return [
            _ignored(
                first,
                f"Accelerate reads fp8_config only with mixed_precision: fp8, and {said}",
                "Set mixed_precision: fp8 to train in FP8, or delete fp8_config.",
                *((mp,) if mp is not None else ()),
            )
        ]
    out = []
    backend = fp8.get("backend")
    name = str(backend.value).upper() if backend is not None else None
    for key, s in fp8.items():
        if key in RENAMED:
            out.append(
                _ignored(
                    s,
                    f"accelerate launch exports it as ACCELERATE_FP8_{key.upper()}, and TransformerEngine's "
                    f"recipe reads ACCELERATE_FP8_{RENAMED[key].upper()} (the recipe keeps its default)",
                    f"Rename {s.name} to fp8_config.{RENAMED[key]} (accelerate config writes the old name).",
                )
            )
        elif (name == "AO" and key in TE_KEYS) or (name == "TE" and key in AO_KEYS):
            other = "TransformerEngine" if key in TE_KEYS else "torchao"
            out.append(
                _ignored(
                    s,
                    f"it is a {other} setting and fp8_config.backend is {name}",
                    f"Delete {s.name}, or set fp8_config.backend to {'TE' if key in TE_KEYS else 'AO'}.",
                    *((backend,) if backend is not None else ()),
                )
            )
    return out


def _section(cf: ConfigFile, paths: dict[str, tuple[str, ...]]) -> tuple[str, str] | None:
    """(converter name, section) of the first section of these the file writes."""
    for conv, path in paths.items():
        if cf.get(".".join(path) + ".block") is not None:
            return conv, ".".join(path)
    return None


def _titan_ignored(cf: ConfigFile) -> list[Finding]:
    out = []
    listed = torchtitan.converters(cf)
    conv_setting = cf.get("model.converters")
    for paths in (torchtitan.FLOAT8_SECTIONS, torchtitan.MX_SECTIONS):
        found = _section(cf, paths)
        if found is None:
            continue
        conv, section = found
        if not any(c in paths for c in listed):
            block = cf.settings[section + ".block"]
            out.append(
                _ignored(
                    block,
                    f"[model] converters does not list {conv!r}, so torchtitan never builds the converter "
                    f"that reads [{section}]: the run trains without it",
                    f'Add "{conv}" to [model] converters, or delete [{section}].',
                    *((conv_setting,) if conv_setting is not None else ()),
                )
            )
            continue
        pre = cf.get(f"{section}.precompute_float8_dynamic_scale_for_fsdp")
        gather = cf.get(f"{section}.enable_fsdp_float8_all_gather")
        if pre is not None and is_true(pre.value) and (gather is None or not is_true(gather.value)):
            out.append(
                _ignored(
                    pre,
                    "precomputed float8 scales are for the FSDP2 float8 all-gather, which is off",
                    f"Set {section}.enable_fsdp_float8_all_gather = true (tensorwise scaling), or delete {pre.name}.",
                    *((gather,) if gather is not None else ()),
                )
            )
    return out


def _titan_conflicts(cf: ConfigFile) -> list[Finding]:
    out = []
    listed = torchtitan.converters(cf)
    conv = cf.get("model.converters")
    f8 = [c for c in listed if c in torchtitan.FLOAT8_SECTIONS]
    mx = [c for c in listed if c in torchtitan.MX_SECTIONS]
    if f8 and mx and conv is not None:
        out.append(
            finding(
                "CW214",
                (conv,),
                f"model.converters={conv.text} ({conv.location}) lists a float8 and an MX converter: "
                "both swap the same Linears, and the second finds them already converted.",
                f"Keep one: {f8[0]!r} (tensorwise / rowwise float8, sm 8.9+) or {mx[0]!r} (MXFP8, sm 10.0).",
            )
        )
    found = _section(cf, torchtitan.FLOAT8_SECTIONS)
    if found is not None:
        section = found[1]
        recipe = cf.get(f"{section}.recipe_name")
        gather = cf.get(f"{section}.enable_fsdp_float8_all_gather")
        rowwise = recipe is not None and str(recipe.value).lower() != "tensorwise"
        if rowwise and gather is not None and is_true(gather.value) and recipe is not None:
            out.append(
                finding(
                    "CW214",
                    (recipe, gather),
                    f"{said((recipe,))} with {gather.name}=true "
                    f"({gather.location}): torchao all-gathers float8 weights with tensorwise scales only, and "
                    "torchtitan refuses the pair at start ('using enable_fsdp_float8_all_gather together "
                    "with recipe_name is not supported').",
                    f"Set {gather.name} = false for {recipe.text} scaling, or drop {recipe.name} "
                    "(tensorwise) to keep the float8 all-gather.",
                )
            )
    return out


def _refused(s: Setting, why: str, fix: str) -> Finding:
    return finding("CW214", (s,), f"{said((s,))}: {why}.", fix)


def _lightning(cf: ConfigFile) -> list[Finding]:
    out = []
    for key, s in cf.settings.items():
        if not key.startswith("te_recipe."):
            continue
        k = key.split(".", 1)[1]
        if k not in DELAYED_SCALING:
            near = RENAMED.get(k, "")
            out.append(
                _refused(
                    s,
                    f"TransformerEnginePrecision passes the recipe to DelayedScaling, which takes no {k!r} "
                    "(TypeError when the Trainer is built)",
                    (
                        f"Rename it to {near}."
                        if near
                        else f"Delete it; DelayedScaling takes: {', '.join(sorted(DELAYED_SCALING))}."
                    ),
                )
            )
        elif k == "fp8_format" and s.value not in TE_FORMATS:
            out.append(
                _refused(
                    s,
                    "Lightning looks the format up as an attribute of TransformerEngine's Format enum, whose "
                    f"names are {', '.join(TE_FORMATS)} (case matters: AttributeError when the Trainer is built)",
                    f"Set it to one of {', '.join(TE_FORMATS)}.",
                )
            )
    return out


def _megatron(cf: ConfigFile) -> list[Finding]:
    out = []
    try:
        notes = vocab.notes(megatron.command_line(cf))
    except PolicyError:
        return []  # a command line castwise refuses says so where it is parsed as a policy
    for note in notes:
        flag, _, why = note.partition(" is inert: ")
        s = cf.get(flag)
        if why and s is not None:
            fp4 = flag.startswith("--fp4")
            if cf.path.endswith((".yaml", ".yml")) or s.name.startswith("mixed_precision"):
                fix = f"Set mixed_precision.{'fp4: e2m1' if fp4 else 'fp8: e4m3 (or hybrid)'}"
            else:
                fix = "Add --fp4-format e2m1" if fp4 else "Add --fp8-format e4m3 (or hybrid)"
            out.append(_ignored(s, why, f"{fix} to train with it, or delete {s.name}."))
    return out


def run_checks(files: Sequence[ConfigFile]) -> list[Finding]:
    out: list[Finding] = []
    for cf in files:
        if cf.format == "accelerate":
            out += _accelerate(cf)
        elif cf.format == "lightning":
            out += _lightning(cf)
        elif cf.format == "torchtitan":
            out += _titan_ignored(cf) + _titan_conflicts(cf)
        elif cf.format == "megatron":
            out += _megatron(cf)
        elif cf.format == "megatron-bridge":
            out += _megatron(megatron_bridge.megatron_view(cf))
    return out
