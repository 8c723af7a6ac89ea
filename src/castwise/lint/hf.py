"""Hugging Face TrainingArguments as JSON (or YAML): what HfArgumentParser.parse_json_file
reads, e.g. the single JSON file the transformers example scripts and TRL accept.

Semantics (huggingface/transformers training_args.py, integrations/deepspeed.py, trainer.py):
- ``fp16`` / ``bf16``: mixed precision through Accelerate (autocast; fp16 adds a GradScaler);
  the model's weights are not cast. Both true is refused ("At most one of fp16 and bf16 can be
  True, but not both"); likewise ``fp16_full_eval`` with ``bf16_full_eval``.
- ``fp16_full_eval`` / ``bf16_full_eval``: evaluation runs the model cast to that dtype.
- ``half_precision_backend`` (transformers 4.x): ``auto``, ``apex`` or ``cpu_amp``.
- ``deepspeed``: a path to a DeepSpeed JSON, or the config as a dict. HfTrainerDeepSpeedConfig
  fills "auto" values and collects mismatches between non-auto DeepSpeed values and the
  arguments (``fill_match("fp16.enabled", args.fp16 or args.fp16_full_eval)``, same for bf16),
  then raises "Please correct the following DeepSpeed config values that mismatch
  TrainingArguments values".
- ``use_cpu`` (formerly ``no_cuda``): train on CPU.
- ``torch_dtype`` / ``dtype`` (ModelArguments of the example scripts) and
  ``model_init_kwargs.torch_dtype`` (TRL): the dtype the model's weights are loaded in.
  fp16 AMP over float16 weights fails in GradScaler.unscale_ ("Attempting to unscale FP16
  gradients").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from castwise.lint import deepspeed
from castwise.lint._source import Document, Path_
from castwise.lint.model import ConfigFile, Setting, Traced, dtype_of, is_scalar, is_true
from castwise.policy import presets

KEYS: dict[str, Path_] = {
    "fp16": ("fp16",),
    "bf16": ("bf16",),
    "fp16_full_eval": ("fp16_full_eval",),
    "bf16_full_eval": ("bf16_full_eval",),
    "half_precision_backend": ("half_precision_backend",),
    "tf32": ("tf32",),
    "deepspeed": ("deepspeed",),
    "fsdp": ("fsdp",),
    "use_cpu": ("use_cpu",),
    "no_cuda": ("no_cuda",),
    "optim": ("optim",),
}
DTYPE_KEYS: tuple[Path_, ...] = (
    ("torch_dtype",),
    ("dtype",),
    ("model_init_kwargs", "torch_dtype"),
    ("model_init_kwargs", "dtype"),
)
MARKERS: frozenset[str] = frozenset(
    {
        "output_dir",
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "half_precision_backend",
        "fp16_full_eval",
        "bf16_full_eval",
        "evaluation_strategy",
        "eval_strategy",
        "save_strategy",
        "logging_steps",
        "fp16_opt_level",
        "gradient_checkpointing",
        "warmup_ratio",
        "lr_scheduler_type",
    }
)


def is_hf_mapping(data: dict[str, Any]) -> bool:
    if isinstance(data.get("fp16"), bool) or isinstance(data.get("bf16"), bool):
        return True
    return any(k in data for k in MARKERS)


def read(doc: Document, shown: str, base: Path, load_link: Callable[[Path, str, Setting], ConfigFile]) -> ConfigFile:
    settings: dict[str, Setting] = {}
    rejected: dict[str, Setting] = {}
    for key in KEYS:
        value = doc.data.get(key)
        if is_scalar(value):
            settings[key] = Setting(key, value, shown, doc.line((key,)))
        elif value is not None and key not in ("deepspeed", "fsdp"):  # those two may be a mapping / list
            rejected[key] = Setting(key, value, shown, doc.line((key,)))
    for path in DTYPE_KEYS:
        node = doc.at(path)
        if isinstance(node, str) and "weights_dtype" not in settings:
            settings["weights_dtype"] = Setting(".".join(str(p) for p in path), node, shown, doc.line(path))
    links: tuple[ConfigFile, ...] = ()
    ds = doc.data.get("deepspeed")
    if isinstance(ds, dict):
        links = (deepspeed.read(doc, shown, ("deepspeed",), linked_from="deepspeed"),)
    elif isinstance(ds, str) and ds.strip():
        setting = settings["deepspeed"]
        target = Path(ds.strip()).expanduser()
        # the Trainer opens the path from its working directory; castwise also looks beside the
        # JSON, where a config and its DeepSpeed file usually live together
        candidate = target if target.is_absolute() else base / target
        if not candidate.exists() and not target.is_absolute() and target.exists():
            candidate = target
        links = (load_link(candidate, str(candidate), setting),)
    return ConfigFile(shown, "hf-training-args", settings, links, rejected=rejected)


def flags(cf: ConfigFile) -> dict[str, tuple[bool, tuple[Setting, ...]]]:
    """What TrainingArguments fill into DeepSpeed's fp16/bf16 "auto" values."""
    out: dict[str, tuple[bool, tuple[Setting, ...]]] = {}
    for dt in ("fp16", "bf16"):
        sources = tuple(s for k in (dt, f"{dt}_full_eval") if (s := cf.get(k)) is not None and is_true(s.value))
        out[f"{dt}.enabled"] = (bool(sources), sources or tuple(s for k in (dt,) if (s := cf.get(k)) is not None))
    return out


def contribute(cf: ConfigFile, put: Any) -> None:
    fp16, bf16 = cf.get("fp16"), cf.get("bf16")
    wd = cf.get("weights_dtype")
    weights = dtype_of(wd.value) if wd is not None else None
    if wd is not None and weights is not None:
        put("weights", Traced(weights, (wd,), "the model is loaded in this dtype"))
        put("gradients", Traced(weights, (wd,), "gradients follow the weights"))
        put("optimizer_state", Traced(weights, (wd,), "optimizer state follows the parameters' dtype"))
    else:
        for name in ("weights", "gradients", "optimizer_state"):
            put(name, Traced("float32", (), "the Trainer does not cast the model's weights"), weak=True)
    # the Trainer hands fp16/bf16 to Accelerate: they mean Accelerate's mixed_precision values
    fp16_amp, bf16_amp = presets.PRESETS["fp16"], presets.PRESETS["bf16"]
    if fp16 is not None and is_true(fp16.value):
        put("compute", Traced(fp16_amp.compute, (fp16,), "autocast to float16"))
        backend = cf.get("half_precision_backend")
        src = (fp16, backend) if backend is not None and str(backend.value) == "apex" else (fp16,)
        put(
            "loss_scaling",
            Traced(fp16_amp.loss_scaling, src, "fp16 AMP uses a GradScaler (apex: its own dynamic scaler)"),
        )
    elif bf16 is not None and is_true(bf16.value):
        put("compute", Traced(bf16_amp.compute, (bf16,), "autocast to bfloat16"))
        put("loss_scaling", Traced(bf16_amp.loss_scaling, (bf16,), "bf16 needs no loss scaling"))
    elif wd is not None and weights is not None:
        put("compute", Traced(weights, (wd,), "no autocast: the model runs in its weights' dtype"))
        put("loss_scaling", Traced("none", (), "neither fp16 nor bf16 is set: no GradScaler"))
    fsdp = cf.get("fsdp")
    amp = next((s for s in (fp16, bf16) if s is not None and is_true(s.value)), None)
    if fsdp is not None and isinstance(fsdp.value, str) and fsdp.value.strip() and amp is not None:
        # the Trainer hands fp16/bf16 to Accelerate's FSDP plugin: MixedPrecision(reduce_dtype=dtype)
        dt = "float16" if amp is fp16 else "bfloat16"
        put("reduce", Traced(dt, (amp, fsdp), "FSDP MixedPrecision reduces in the mixed-precision dtype"))
    for key in ("use_cpu", "no_cuda"):
        s = cf.get(key)
        if s is not None and is_true(s.value):
            put("device", Traced("cpu", (s,), f"{key}: train on CPU"))
            break
