"""SimpleTuner: config.env (shell exports), config.json and config.toml.

Semantics (bghira/SimpleTuner):
- config.env variables map to train.py arguments (helpers/configuration/env_file.py:
  MIXED_PRECISION -> --mixed_precision, BASE_MODEL_PRECISION -> --base_model_precision,
  OPTIMIZER -> --optimizer, ...); TRAINER_EXTRA_ARGS is appended to the command line, so its
  arguments come last and win (argparse keeps the last occurrence).
- config.json / config.toml: keys are the argument names, with or without the leading ``--``
  (documentation/OPTIONS.md, "JSON Configuration file format").
- weight dtype: ``weight_dtype = bfloat16 if mixed_precision == "bf16" ... else float32``, and
  for a quantised base (``--base_model_precision`` other than ``no_change``) the unquantised
  weights use ``--base_model_default_dtype`` (train.py / helpers/training/trainer.py).
- ``--gradient_precision=fp32``: after ``accelerator.backward`` the trainer converts every
  ``param.grad`` to float32 (``param.grad.data = param.grad.data.to(torch.float32)``), except
  with the ``adam_bfloat16`` optimizer (helpers/training/trainer.py, _handle_backward_step).
"""

from __future__ import annotations

from typing import Any

from castwise.lint._source import Assignment, Document, parse_shell
from castwise.lint.accelerate import compute_and_scaling
from castwise.lint.model import ConfigFile, Setting, Traced, dtype_of, is_scalar

# config.env variable -> train.py argument, for the settings castwise reads
ENV_TO_ARG: dict[str, str] = {
    "MIXED_PRECISION": "mixed_precision",
    "BASE_MODEL_PRECISION": "base_model_precision",
    "OPTIMIZER": "optimizer",
    "MODEL_TYPE": "model_type",
    "GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
}
ARGS: frozenset[str] = frozenset(
    {
        "mixed_precision",
        "gradient_precision",
        "base_model_precision",
        "base_model_default_dtype",
        "optimizer",
        "model_type",
        "gradient_accumulation_steps",
    }
)
# keys only SimpleTuner's JSON/TOML configs carry (to tell them from TrainingArguments JSON)
MARKERS: frozenset[str] = frozenset(
    {
        "model_family",
        "base_model_precision",
        "gradient_precision",
        "base_model_default_dtype",
        "data_backend_config",
        "lora_type",
        "resolution_type",
        "validation_prompt",
        "caption_dropout_probability",
        "text_encoder_1_precision",
        "quantize_via",
    }
)

# config.env variables only SimpleTuner's train.sh reads: a shell file setting none of them (a
# launch script of another project) is not a SimpleTuner config
ENV_MARKERS: frozenset[str] = frozenset(
    {*ENV_TO_ARG, "TRAINER_EXTRA_ARGS", "MODEL_FAMILY", "DATALOADER_CONFIG", "TRAINING_DYNAMO_BACKEND"}
)


def is_simpletuner_env(assignments: list[Assignment]) -> bool:
    return any(a.name in ENV_MARKERS for a in assignments)


def read_env(text: str, shown: str) -> ConfigFile:
    settings: dict[str, Setting] = {}
    extra = None
    for a in parse_shell(text, shown):
        arg = ENV_TO_ARG.get(a.name)
        if arg is not None:
            settings[arg] = Setting(a.name, a.value.text, shown, a.value.line)
        elif a.name == "TRAINER_EXTRA_ARGS":
            extra = a.value  # the last assignment holds the whole, expanded value
    if extra is not None:
        words = extra.words()
        i = 0
        while i < len(words):
            word, line = words[i]
            i += 1
            if not word.startswith("--"):
                continue
            key, eq, value = word[2:].partition("=")
            val: Any = value
            if not eq:
                if i < len(words) and not words[i][0].startswith("--"):
                    val = words[i][0]
                    i += 1
                else:
                    val = True  # a flag
            if key in ARGS:
                settings[key] = Setting(f"--{key}", val, shown, line)
    return ConfigFile(shown, "simpletuner", settings)


def read_mapping(doc: Document, shown: str) -> ConfigFile:
    settings: dict[str, Setting] = {}
    rejected: dict[str, Setting] = {}
    for key, value in doc.data.items():
        arg = key[2:] if key.startswith("--") else key
        if arg in ARGS and is_scalar(value):
            settings[arg] = Setting(key, value, shown, doc.line((key,)))
        elif arg in ARGS and value is not None:
            rejected[arg] = Setting(key, value, shown, doc.line((key,)))
    return ConfigFile(shown, "simpletuner", settings, rejected=rejected)


def is_simpletuner_mapping(data: dict[str, Any]) -> bool:
    return any(k.startswith("--") for k in data) or any(k in MARKERS for k in data)


def contribute(cf: ConfigFile, put: Any) -> None:
    """Add this file's facts to the model being built (`put(field, Traced)`)."""
    mp = cf.get("mixed_precision")
    mp_value = str(mp.value).lower() if mp is not None else None
    bmp = cf.get("base_model_precision")
    bmp_value = str(bmp.value).lower() if bmp is not None else "no_change"
    default_dtype = cf.get("base_model_default_dtype")

    weights: Traced | None = None
    if dtype_of(bmp_value) is not None and bmp is not None:
        # a dtype given as the base precision: the weights are stored in it
        sources = (mp, bmp) if mp is not None and dtype_of(mp_value) == dtype_of(bmp_value) else (bmp,)
        weights = Traced(str(dtype_of(bmp_value)), sources, "base weights stored in --base_model_precision")
    elif bmp_value != "no_change" and bmp is not None:
        dt = dtype_of(default_dtype.value) if default_dtype is not None else None
        if dt is not None and default_dtype is not None:
            weights = Traced(
                dt, (bmp, default_dtype), "quantised base; unquantised weights use --base_model_default_dtype"
            )
    elif mp is None:
        # train.py: parser.add_argument("--mixed_precision", default="bf16", ...)
        weights = Traced("bfloat16", (), "SimpleTuner's default --mixed_precision is bf16, which stores bf16 weights")
    else:
        if mp_value == "bf16":
            weights = Traced("bfloat16", (mp,), "SimpleTuner stores the weights in bf16 when mixed_precision is bf16")
        else:
            weights = Traced("float32", (mp,), "SimpleTuner keeps float32 weights unless mixed_precision is bf16")
    if weights is not None:
        put("weights", weights)

    if mp is None:
        put("compute", Traced("bfloat16", (), "SimpleTuner's default --mixed_precision is bf16"))
        put("loss_scaling", Traced("none", (), "no GradScaler for bf16"))
    else:
        # SimpleTuner hands mixed_precision to Accelerate: its meaning is Accelerate's
        compute, scaling = compute_and_scaling(str(mp_value))
        put("compute", Traced(compute, (mp,), "Accelerate autocast in the mixed_precision dtype"))
        put("loss_scaling", Traced(scaling, (mp,), "Accelerate's GradScaler runs for fp16 only"))

    gp = cf.get("gradient_precision")
    opt = cf.get("optimizer")
    if gp is not None and str(gp.value).lower() == "fp32":
        if opt is not None and str(opt.value) == "adam_bfloat16":
            put(
                "gradients",
                Traced(
                    weights.value if weights else "float32", (gp, opt), "adam_bfloat16 skips the fp32 gradient cast"
                ),
            )
        else:
            put(
                "gradients",
                Traced("float32", (gp,), "param.grad converted to float32 after backward"),
                mechanism="cast",
            )
    elif weights is not None:
        put("gradients", Traced(weights.value, weights.settings, "gradients follow the weights"))
    if weights is not None:
        put(
            "optimizer_state",
            Traced(weights.value, weights.settings, "PyTorch optimizers keep state in the parameters' dtype"),
        )
