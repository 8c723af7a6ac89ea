"""castwise's torch-free precision model of a training run, traced back to the settings.

A reader turns one file into a `ConfigFile` (its precision-relevant settings, each exactly as
written, with file and line). `build_model` combines the files of one run into a
`PrecisionModel`: what the run will do (weights, compute, gradient, optimizer-state and reduce
dtypes, loss scaling, device), each value with the settings it comes from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from castwise._dtypes import canonical, short
from castwise.report import Finding
from castwise.rules._rule import Severity

FORMATS: dict[str, str] = {
    "accelerate": "Accelerate config (default_config.yaml)",
    "deepspeed": "DeepSpeed config (JSON)",
    "hf-training-args": "Hugging Face TrainingArguments (JSON or YAML)",
    "lightning": "Lightning / LightningCLI config (YAML)",
    "simpletuner": "SimpleTuner config (config.env, config.json, config.toml)",
    "megatron": "Megatron-LM launch script (pretrain_gpt.sh command line)",
    "megatron-bridge": "Megatron-Bridge config (YAML, its mixed_precision)",
    "torchtitan": "torchtitan job config (TOML)",
}


@dataclass(frozen=True)
class Setting:
    """One setting as written in a file: `MIXED_PRECISION`, `--gradient_precision`,
    `bf16.enabled`, `trainer.precision`, with its value and where it is."""

    name: str
    value: Any
    file: str
    line: int

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def text(self) -> str:
        """The value as a user reads it."""
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        return str(self.value)

    def to_dict(self) -> dict[str, Any]:
        value = self.value if isinstance(self.value, (str, int, float, bool)) or self.value is None else str(self.value)
        return {"name": self.name, "value": value, "location": self.location}


@dataclass(frozen=True)
class ConfigFile:
    """One file read: its format and its precision settings by canonical key.

    ``settings`` keys are the format's own canonical names (``mixed_precision``,
    ``fp16.enabled``, ``trainer.precision``); each Setting keeps the name as written.
    ``links`` are the files this one points to (an Accelerate or TrainingArguments DeepSpeed
    file), already read. ``rejected``: settings whose value is not a scalar where one belongs.
    """

    path: str
    format: str
    settings: dict[str, Setting] = field(default_factory=dict)
    links: tuple[ConfigFile, ...] = ()
    linked_from: str | None = None  # the setting that points here, e.g. "deepspeed_config_file"
    # known settings whose value has the wrong type (a list for a flag): kept out of ``settings``
    # so the model never acts on them, and reported (CW220)
    rejected: dict[str, Setting] = field(default_factory=dict)

    def get(self, key: str) -> Setting | None:
        return self.settings.get(key)

    def value(self, key: str) -> Any:
        s = self.settings.get(key)
        return None if s is None else s.value


@dataclass(frozen=True)
class Traced:
    """A value of the precision model and the settings it comes from (empty: a default)."""

    value: str  # a canonical dtype name ("bfloat16"), or a word for non-dtype facts
    settings: tuple[Setting, ...] = ()
    note: str = ""  # how the value follows from the settings, with its source in the project

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "settings": [s.to_dict() for s in self.settings], "note": self.note}

    def show(self) -> str:
        return short(self.value)


FIELDS: tuple[str, ...] = (
    "weights",
    "compute",
    "gradients",
    "loss_scaling",
    "optimizer_state",
    "reduce",
    "device",
)
# the precision ledger's further fields (castwise.ledger), shown only where a file decides them
LEDGER_EXTRA: tuple[str, ...] = ("master", "state_scheme", "rounding", "checkpoint_load", "accumulate_steps")


@dataclass(frozen=True)
class PrecisionModel:
    """What the run will do. A field is None when no file says (castwise does not guess).

    - weights: dtype the trained parameters are stored in
    - compute: dtype matmuls run in (autocast dtype, or the weights' dtype without autocast)
    - gradients: dtype of ``param.grad`` when the optimizer steps
    - loss_scaling: ``dynamic``, ``static:<scale>`` or ``none``
    - optimizer_state: dtype of the optimizer's state / master weights
    - reduce: dtype gradients are all-reduced in across processes
    - device: ``cuda``, ``cpu``, ``xla``, ``mps`` or a GPU model (``cuda:V100``)
    """

    weights: Traced | None = None
    compute: Traced | None = None
    gradients: Traced | None = None
    loss_scaling: Traced | None = None
    optimizer_state: Traced | None = None
    reduce: Traced | None = None
    device: Traced | None = None
    # how gradients reach their dtype: "autograd" (follow the weights), "cast" (converted
    # after backward, e.g. SimpleTuner --gradient_precision=fp32), "accumulate" (a separate
    # accumulation buffer, e.g. DeepSpeed data_types.grad_accum_dtype)
    gradient_mechanism: str = "autograd"
    # the ledger's further fields (LEDGER_EXTRA): the master copy's dtype, the optimizer state's
    # scheme (f32, bf16, f16, 8-bit, 4-bit, fp8), its rounding (stochastic, kahan, none), the dtype a
    # checkpoint loads in, and the gradient-accumulation micro-batch count
    master: Traced | None = None
    state_scheme: Traced | None = None
    rounding: Traced | None = None
    checkpoint_load: Traced | None = None
    accumulate_steps: Traced | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: (v.to_dict() if (v := getattr(self, k)) is not None else None) for k in FIELDS}
        out["gradient_mechanism"] = self.gradient_mechanism
        # only where a file decides them: the reports of configs that say nothing stay as they were
        out.update({k: v.to_dict() for k in LEDGER_EXTRA if (v := getattr(self, k)) is not None})
        return out


def said(settings: Iterable[Setting]) -> str:
    """Settings as a finding names them: ``name=value (file:line)``, joined by "and"."""
    return " and ".join(f"{s.name}={s.text} ({s.location})" for s in settings)


def finding(
    code: str, settings: Iterable[Setting], message: str, fix: str, severity: Severity | None = None
) -> Finding:
    """A lint-config finding naming each setting involved once, with where it is."""
    pairs = list(dict.fromkeys((s.name, s.location) for s in settings))
    return Finding(
        code=code,
        message=message,
        fix=fix,
        severity=severity,
        settings=tuple(p[0] for p in pairs),
        locations=tuple(p[1] for p in pairs),
    )


def is_scalar(value: Any) -> bool:
    """A value a setting can hold as written: a string, number or boolean."""
    return isinstance(value, (str, int, float, bool))


def dtype_of(value: Any) -> str | None:
    """A setting's value as a canonical dtype name, or None (``"bf16"`` -> ``"bfloat16"``)."""
    if isinstance(value, bool) or value is None:
        return None
    return canonical(str(value))


def is_true(value: Any) -> bool:
    """JSON/YAML/shell truthiness as the projects parse it (true, "true", "True", 1)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    return isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on")


def is_false(value: Any) -> bool:
    """Explicitly false (not merely missing, and not "auto")."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value == 0
    return isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off")


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"
