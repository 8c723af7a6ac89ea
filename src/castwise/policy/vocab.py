"""Precision settings other tools write as flags or keys, rewritten into castwise's grammar.

Most tools name their precision with one word, which ``castwise.policy.presets`` looks up. Two
write several settings that together make one precision:

- Megatron-LM's command line: ``--bf16`` / ``--fp16`` (presets of the same name), plus
  ``--fp8-format e4m3|hybrid`` which turns float8 on and ``--fp8-recipe
  delayed|tensorwise|mxfp8|blockwise`` (default ``delayed``): ``"--bf16 --fp8-format hybrid"``
  reads as ``"--bf16,fp8=delayed"``.
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
from castwise.policy.float8 import SCALINGS

__all__ = ["translate"]

_MEGATRON_FLAGS = ("--bf16", "--fp16", "--fp8-format", "--fp8-recipe")
_TORCHTITAN = ("mixed_precision_param", "mixed_precision_reduce")
# torchtitan's param dtype -> the castwise policy FSDP2 runs (no GradScaler in torchtitan)
_TORCHTITAN_BASE = {
    "bfloat16": "bf16-mixed,output=bf16",
    "float16": "16-mixed,output=f16,loss_scale=none",
    "float32": "32-true",
}


def _megatron(head: str) -> str:
    words = head.replace("=", " ").split()
    base, fmt, recipe = "32-true", None, "delayed"
    i = 0
    while i < len(words):
        flag = words[i].lower()
        if flag in ("--bf16", "--fp16"):
            base = flag
        elif flag in ("--fp8-format", "--fp8-recipe") and i + 1 < len(words):
            value = words[i + 1].lower()
            valid = ("e4m3", "hybrid") if flag == "--fp8-format" else ("delayed", "tensorwise", "mxfp8", "blockwise")
            if value not in valid:
                raise PolicyError(f"Megatron {flag} {words[i + 1]!r} is not valid; valid: {', '.join(valid)}")
            fmt, recipe = (value, recipe) if flag == "--fp8-format" else (fmt, value)
            i += 1
        else:
            raise PolicyError(
                f"Megatron flag {words[i]!r} in {head!r} is not one castwise reads; valid: "
                f"{', '.join(_MEGATRON_FLAGS)} (with --fp8-format e4m3|hybrid, --fp8-recipe "
                f"{'|'.join(s for s in SCALINGS if s != 'rowwise')})"
            )
        i += 1
    if fmt is None:
        if recipe != "delayed" or "--fp8-recipe" in head.lower():
            raise PolicyError(f"{head!r}: Megatron turns float8 on with --fp8-format (e4m3 or hybrid); add it")
        return base
    return f"{base},fp8={recipe}:{fmt}"


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


def translate(clauses: list[str]) -> list[str]:
    """``clauses`` (a split policy string) with Megatron flags and torchtitan keys rewritten."""
    if clauses and clauses[0].lstrip().startswith("--"):
        clauses = [*_megatron(clauses[0]).split(","), *clauses[1:]]
    if any(c.partition("=")[0].strip().lower() in _TORCHTITAN for c in clauses):
        clauses = _torchtitan(clauses)
    return clauses
