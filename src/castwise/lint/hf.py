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

import json
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
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "learning_rate": ("learning_rate",),
    "optim_args": ("optim_args",),
    "transformers_version": ("transformers_version",),
    "model_name_or_path": ("model_name_or_path",),
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


# TrainingArguments.optim -> (state scheme, state dtype, source). transformers trainer_optimizer.py
# dispatches: _get_adamw_torch (torch.optim.AdamW: state ``zeros_like(p)``, the parameter's dtype),
# _get_bitsandbytes_optimizer (``optim_bits = 8 if "8bit" in optim_name else 32``; bitsandbytes
# optim/optimizer.py ``Optimizer8bit.init_state``: uint8 blockwise state for tensors of at least
# ``min_8bit_size`` = 4096 elements, float32 below; 32-bit: float32 state), _get_torchao_optimizer
# (torchao/optim/adam.py ``_AdamBase._new_buffer``: 8-bit / 4-bit for tensors of at least 4096
# elements divisible by the block size, ``zeros_like(p)`` below). "param" = the parameter's dtype.
_PARAM = "param"
OPTIM_STATE: dict[str, tuple[str, str, str]] = {
    **{
        name: (_PARAM, _PARAM, "torch.optim: state zeros_like(p)")
        for name in ("adamw_torch", "adamw_torch_fused", "adagrad", "rmsprop")
    },
    # _get_sgd: torch.optim.SGD with momentum from optim_args only; momentum 0 keeps no buffer
    "sgd": ("none", "none", "torch.optim.SGD without momentum keeps no state"),
    **{
        name: ("8-bit", "uint8", "bitsandbytes Optimizer8bit: uint8 blockwise (float32 below 4096 elements)")
        for name in (
            "adamw_bnb_8bit",
            "adamw_8bit",
            "paged_adamw_8bit",
            "lion_8bit",
            "paged_lion_8bit",
            "ademamix_8bit",
            "paged_ademamix_8bit",
            "rmsprop_bnb_8bit",
        )
    },
    **{
        name: ("f32", "float32", "bitsandbytes 32-bit optimizers keep float32 state")
        for name in ("paged_adamw_32bit", "lion_32bit", "paged_lion_32bit", "rmsprop_bnb_32bit")
    },
    "adamw_torch_8bit": ("8-bit", "uint8", "torchao AdamW8bit: uint8 blockwise (param dtype below 4096 elements)"),
    "adamw_torch_4bit": (
        "4-bit",
        "uint8",
        "torchao AdamW4bit: 4-bit codes packed in uint8 (param dtype below 4096 elements)",
    ),
}
_SCHEME = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def small_tensor_state(optim: str) -> str | None:
    """The state dtype of tensors too small to quantize (under 4096 elements) for a low-bit
    ``optim``: bitsandbytes keeps them float32, torchao ``zeros_like(p)`` ("param"); None for
    an optimizer that treats every tensor alike."""
    scheme, _, note = OPTIM_STATE.get(optim, ("", "", ""))
    if scheme not in ("8-bit", "4-bit"):
        return None
    return "float32" if note.startswith("bitsandbytes") else _PARAM


def _checkpoint_dtype(cf: ConfigFile) -> str | None:
    """The dtype a local checkpoint was saved in (its config.json ``dtype`` / ``torch_dtype``)."""
    path = cf.get("model_name_or_path")
    if path is None or not isinstance(path.value, str) or not path.value.strip():
        return None
    folder = Path(path.value).expanduser()
    folder = folder if folder.is_absolute() else Path(cf.path).parent / folder
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a hub id or an unreadable folder: castwise does not download
    found = data.get("dtype") or data.get("torch_dtype") if isinstance(data, dict) else None
    return dtype_of(found) if isinstance(found, str) else None


def _loaded_dtype(cf: ConfigFile) -> tuple[str, tuple[Setting, ...], str]:
    """The dtype ``from_pretrained`` loads the weights in. transformers modeling_utils.py
    ``PreTrainedModel.from_pretrained``: an explicit dtype wins; ``"auto"`` takes the checkpoint's;
    unset, transformers 5 defaults to ``dtype="auto"`` while 4.x loads in torch's default float32."""
    wd = cf.get("weights_dtype")
    given = dtype_of(wd.value) if wd is not None else None
    if wd is not None and given is not None:
        return given, (wd,), "the model is loaded in this dtype"
    version = cf.get("transformers_version")
    major = str(version.value).split(".")[0] if version is not None else ""
    auto = wd is not None and str(wd.value).strip().lower() == "auto"
    if not auto and major == "4":
        return "float32", (version,) if version else (), "transformers 4 loads in float32 unless told"
    if not auto and major != "5":
        why = "the loading dtype depends on the transformers version (5: the checkpoint's, 4: float32)"
        return "unknown", (), why + "; set torch_dtype or transformers_version"
    src = tuple(s for s in (wd, version) if s is not None)
    ckpt = _checkpoint_dtype(cf)
    if ckpt is not None:
        return ckpt, src, "the checkpoint's dtype (its config.json)"
    return "unknown", src, "the checkpoint's dtype, which these files do not say"


def contribute(cf: ConfigFile, put: Any) -> None:
    fp16, bf16 = cf.get("fp16"), cf.get("bf16")
    weights, wsrc, wnote = _loaded_dtype(cf)
    known = weights != "unknown"
    put("weights", Traced(weights, wsrc, wnote), weak=not wsrc)
    put("gradients", Traced(weights, wsrc, "gradients follow the weights"), weak=not wsrc)
    put("checkpoint_load", Traced(weights, wsrc, wnote), weak=not wsrc)
    optim = cf.get("optim")
    name = str(optim.value).strip().lower() if optim is not None else "adamw_torch"
    scheme, state, note = OPTIM_STATE.get(name, ("unknown", "unknown", f"castwise does not model optim={name}"))
    args = cf.get("optim_args")
    if name == "sgd" and args is not None and "momentum" in str(args.value):
        scheme, state, note = _PARAM, _PARAM, "torch.optim.SGD momentum_buffer: clone of the gradient"
    if state == _PARAM:
        state, scheme = weights, _SCHEME.get(weights, "unknown")
    osrc = (optim, *wsrc) if optim is not None else wsrc
    put("optimizer_state", Traced(state, osrc, note), weak=not osrc)
    put("state_scheme", Traced(scheme, osrc, note), weak=not osrc)
    put("master", Traced("none", (), "the Trainer keeps no separate master copy"), weak=True)
    put("rounding", Traced("none" if scheme != "unknown" else "unknown", osrc, note), weak=True)
    steps = cf.get("gradient_accumulation_steps")
    if steps is not None and isinstance(steps.value, int) and not isinstance(steps.value, bool):
        put("accumulate_steps", Traced(str(steps.value), (steps,), "micro-batches per optimizer step"))
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
    elif known:
        put("compute", Traced(weights, wsrc, "no autocast: the model runs in its weights' dtype"))
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
