"""CW220: a precision setting whose value has the wrong type or is not one the tool accepts.

The readers keep every scalar setting and set aside (``ConfigFile.rejected``) the values of a
known setting that are not scalars (``bf16: [1, 2]``), so the precision model never acts on
them. This module says, per format and setting, which values the tool accepts, and reports each
setting whose value is not one of them: a value the tool refuses at start, or, worse, one it
reads as something else (TrainingArguments takes any non-empty string for ``bf16`` as true).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from castwise.lint.model import ConfigFile, Setting, finding, is_auto, is_false, is_true
from castwise.policy import presets, toolnames, vocab
from castwise.report import Finding

__all__ = ["ACCEPTED", "Accepted", "check_values"]


def _flag(value: Any) -> bool:
    """A JSON/YAML boolean, or 0/1."""
    return isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))


def _flag_or_auto(value: Any) -> bool:
    # DeepSpeed's config model coerces "true"/"false" strings; "auto" is filled by the launcher
    return _flag(value) or is_auto(value) or (isinstance(value, str) and (is_true(value) or is_false(value)))


def _one_of(*words: str) -> Callable[[Any], bool]:
    allowed = {w.lower() for w in words}

    def accepts(value: Any) -> bool:
        if isinstance(value, bool):
            return False
        return isinstance(value, (str, int)) and str(value).strip().lower() in allowed

    return accepts


@dataclass(frozen=True)
class Accepted:
    """What a tool accepts for one setting: a test, and the values as a message lists them."""

    test: Callable[[Any], bool]
    valid: str
    why: str = ""  # what the tool does with another value, when it does not simply refuse it


_FLAG = Accepted(_flag, "false, true")
_HF_FLAG = Accepted(
    _flag,
    "false, true",
    "TrainingArguments does not convert it: any non-empty string or list counts as true",
)
_DS_ENABLED = Accepted(_flag_or_auto, '"auto", false, true')
_DS_BLOCK = Accepted(
    lambda value: isinstance(value, dict), '{"enabled": true}, {"enabled": false}, {"enabled": "auto"}'
)
_MIXED_PRECISION = Accepted(_one_of("no", "fp16", "bf16", "fp8"), "bf16, fp16, fp8, no")
_LIGHTNING_STRINGS = sorted(
    {*presets.LIGHTNING, *presets.LIGHTNING_ALIASES, "transformer-engine", "transformer-engine-float16"}
)
_LIGHTNING = Accepted(_one_of(*_LIGHTNING_STRINGS), ", ".join(_LIGHTNING_STRINGS))

_TITAN_DTYPES = ("bfloat16", "float16", "float32")

# format -> canonical setting key -> what the tool accepts
ACCEPTED: dict[str, dict[str, Accepted]] = {
    "deepspeed": {
        "fp16.enabled": _DS_ENABLED,
        "bf16.enabled": _DS_ENABLED,
        "amp.enabled": _FLAG,
        "fp16.block": _DS_BLOCK,
        "bf16.block": _DS_BLOCK,
    },
    "hf-training-args": {
        **{k: _HF_FLAG for k in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval", "tf32", "use_cpu", "no_cuda")},
        "half_precision_backend": Accepted(
            _one_of("auto", "apex", "cpu_amp", "cuda_amp"), "apex, auto, cpu_amp, cuda_amp"
        ),
    },
    "lightning": {"precision": _LIGHTNING, "plugin_precision": _LIGHTNING},
    "accelerate": {
        "mixed_precision": _MIXED_PRECISION,
        "use_cpu": _FLAG,
        # accelerate launch passes fp8_config on as ACCELERATE_FP8_* (upper-cased by the recipe kwargs)
        "fp8_config.backend": Accepted(_one_of("AO", "TE", "MSAMP"), "AO, MSAMP, TE"),
        "fp8_config.fp8_format": Accepted(_one_of("HYBRID", "E4M3", "E5M2"), "E4M3, E5M2, HYBRID"),
        "fp8_config.amax_compute_algo": Accepted(_one_of("max", "most_recent"), "max, most_recent"),
    },
    "torchtitan": {
        # torchtitan's TORCH_DTYPE_MAP
        "training.dtype": Accepted(_one_of(*_TITAN_DTYPES), ", ".join(_TITAN_DTYPES)),
        "training.mixed_precision_param": Accepted(_one_of(*_TITAN_DTYPES), ", ".join(_TITAN_DTYPES)),
        "training.mixed_precision_reduce": Accepted(_one_of(*_TITAN_DTYPES), ", ".join(_TITAN_DTYPES)),
        # each converter's recipe_name (castwise.policy.toolnames, from torchtitan's and torchao's source)
        **{
            f"{conv}.recipe_name": Accepted(_one_of(*names), ", ".join(sorted(names)))
            for conv, (_, names) in toolnames.TORCHTITAN_CONVERTERS.items()
            if conv.islower()
        },
    },
    # Megatron-Bridge's get_mixed_precision_config: a MIXED_PRECISION_RECIPES name, either spelling
    "megatron-bridge": {
        "mixed_precision": Accepted(
            _one_of(*vocab.BRIDGE, *(n.replace("_", "-") for n in vocab.BRIDGE)), ", ".join(sorted(vocab.BRIDGE))
        )
    },
    "simpletuner": {
        "mixed_precision": _MIXED_PRECISION,
        "gradient_precision": Accepted(_one_of("fp32", "unmodified"), "fp32, unmodified"),
    },
}


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _finding(s: Setting, accepted: Accepted) -> Finding:
    why = f" ({accepted.why})" if accepted.why else ""
    return finding(
        "CW220",
        (s,),
        f"{s.name}={_shown(s.value)} ({s.location}) is not a value this setting takes{why}; valid: {accepted.valid}.",
        f"Set {s.name} in {s.file} to one of: {accepted.valid}.",
    )


def check_values(files: Sequence[ConfigFile]) -> list[Finding]:
    """CW220 for every known setting whose value the tool does not accept: scalars that are
    not among its values, and every value a reader set aside for its type."""
    out = []
    for cf in files:
        table = ACCEPTED.get(cf.format, {})
        for key, s in cf.settings.items():
            accepted = table.get(key)
            # a ".block" setting stands for a block the file writes as a mapping: always valid
            if accepted is not None and not key.endswith(".block") and not accepted.test(s.value):
                out.append(_finding(s, accepted))
        out += [_finding(s, table[key]) for key, s in cf.rejected.items() if key in table]
    return out
