"""DeepSpeed JSON configs (standalone, or pointed to by Accelerate / TrainingArguments).

Semantics (microsoft/DeepSpeed runtime/config.py, runtime/precision_config.py, docs
"config-json"):
- ``fp16.enabled`` / ``bf16.enabled`` (legacy key ``bfloat16``): the engine converts the module
  to that dtype; ZeRO / the FP16 and BF16 optimizers keep float32 master weights and optimizer
  state. Both enabled is refused ("bfloat16 and fp16 modes cannot be simultaneously enabled").
- ``fp16.loss_scale``: 0 (default) is dynamic loss scaling starting at
  ``2**initial_scale_power``; a positive value is a static scale. bf16 uses no loss scaling.
- ``communication_data_type``: dtype of gradient all-reduce (fp16, bf16, fp32); unset, the
  engine communicates in the model's dtype.
- ``data_types.grad_accum_dtype``: dtype of the gradient accumulation buffer.
- ``"auto"`` values are filled by the launcher: Accelerate's DeepSpeedPlugin and
  transformers' HfTrainerDeepSpeedConfig (``fill_match``) replace them from mixed_precision /
  TrainingArguments.
"""

from __future__ import annotations

from typing import Any

from castwise.lint._source import Document, Path_
from castwise.lint.model import ConfigFile, Setting, Traced, dtype_of, is_auto, is_scalar, is_true

# canonical key -> path in the JSON
KEYS: dict[str, Path_] = {
    "fp16.enabled": ("fp16", "enabled"),
    "fp16.loss_scale": ("fp16", "loss_scale"),
    "fp16.initial_scale_power": ("fp16", "initial_scale_power"),
    "bf16.enabled": ("bf16", "enabled"),
    "amp.enabled": ("amp", "enabled"),
    "communication_data_type": ("communication_data_type",),
    "data_types.grad_accum_dtype": ("data_types", "grad_accum_dtype"),
    "zero_optimization.stage": ("zero_optimization", "stage"),
    "bf16.bf16_master_weights_and_grads": ("bf16", "bf16_master_weights_and_grads"),
    "bf16.bf16_optimizer_states": ("bf16", "bf16_optimizer_states"),
    "fp16.fp16_master_weights_and_grads": ("fp16", "fp16_master_weights_and_grads"),
    "torch_autocast.enabled": ("torch_autocast", "enabled"),
    "torch_autocast.dtype": ("torch_autocast", "dtype"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "optimizer.params.lr": ("optimizer", "params", "lr"),
}
MARKERS: frozenset[str] = frozenset(
    {
        "zero_optimization",
        "train_micro_batch_size_per_gpu",
        "zero_allow_untested_optimizer",
        "steps_per_print",
        "wall_clock_breakdown",
        "communication_data_type",
        "amp",
        "bfloat16",
        "zero_force_ds_cpu_optimizer",
        "gradient_clipping",
        "torch_autocast",
    }
)


def is_deepspeed_mapping(data: dict[str, Any]) -> bool:
    if any(isinstance(data.get(k), dict) for k in ("fp16", "bf16", "bfloat16")):
        return True
    return any(k in data for k in MARKERS)


def _get(data: Any, path: Path_) -> tuple[bool, Any]:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return False, None
        data = data[part]
    return True, data


def read(doc: Document, shown: str, prefix: Path_ = (), linked_from: str | None = None) -> ConfigFile:
    """Read a DeepSpeed config; ``prefix`` locates it inside another document (an inline
    ``deepspeed`` dict of TrainingArguments)."""
    _, root = _get(doc.data, prefix)
    settings: dict[str, Setting] = {}
    rejected: dict[str, Setting] = {}
    for key, path in KEYS.items():
        actual = path
        if key == "bf16.enabled" and not _get(root, path)[0] and _get(root, ("bfloat16", "enabled"))[0]:
            actual = ("bfloat16", "enabled")  # DeepSpeed's older spelling
        found, value = _get(root, actual)
        if found and value is not None:
            name = ".".join(str(p) for p in (*prefix, *actual))
            store = settings if is_scalar(value) else rejected
            store[key] = Setting(name, value, shown, doc.line((*prefix, *actual)))
    for block in ("fp16", "bf16", "bfloat16"):
        # whether the block is written at all: Lightning adds a block only where there is none
        found, value = _get(root, (block,))
        key = "bf16.block" if block == "bfloat16" else f"{block}.block"
        name, line = ".".join(str(p) for p in (*prefix, block)), doc.line((*prefix, block))
        if found and isinstance(value, dict):
            settings.setdefault(key, Setting(name, "{...}", shown, line))
        elif found and value is not None:
            rejected.setdefault(key, Setting(name, value, shown, line))  # "bf16": true is not a block
    return ConfigFile(shown, "deepspeed", settings, linked_from=linked_from, rejected=rejected)


Auto = dict[str, tuple[bool, tuple[Setting, ...]]]


def enabled(cf: ConfigFile, key: str, auto: Auto) -> tuple[bool, tuple[Setting, ...]]:
    """Whether ``fp16.enabled`` / ``bf16.enabled`` holds, with the settings that decide it
    ("auto" resolved from the launcher's settings in ``auto``)."""
    s = cf.get(key)
    if s is None:
        return False, ()
    if is_auto(s.value):
        on, sources = auto.get(key, (False, ()))
        return on, (s, *sources)
    return is_true(s.value), (s,)


def _master(cf: ConfigFile, dt: str, src: tuple[Setting, ...]) -> tuple[str, str, tuple[Setting, ...]]:
    """The master copy's and the optimizer state's dtypes, and the settings deciding them.

    deepspeed/runtime/base_optimizer.py ``ZeROOptimizer._configure_master_weights``: fp32 master
    weights unless ``{fp16,bf16}_master_weights_and_grads`` (ZeRO 1-3 only, runtime/config.py
    ``_do_sanity_check``); the state is made over the master partitions, so it has their dtype,
    and ``bf16_optimizer_states`` (which requires bf16 master weights) keeps it bf16; with bf16
    master weights and fp32 states the states live on the CPU in DeepSpeedCPUAdam (fp32).
    """
    key = "bf16.bf16_master_weights_and_grads" if dt == "bfloat16" else "fp16.fp16_master_weights_and_grads"
    low_master = cf.get(key)
    if low_master is None or not is_true(low_master.value):
        return "float32", "float32", src
    states = cf.get("bf16.bf16_optimizer_states")
    if dt == "bfloat16" and states is not None and is_true(states.value):
        return dt, dt, (low_master, states)
    return dt, "float32", (low_master,)


def _autocast(cf: ConfigFile, put: Any) -> bool:
    """DeepSpeed's ``torch_autocast`` (runtime/torch_autocast.py ``init_autocast_params``): the module
    is not converted (``engine.get_data_types``: fp32 without fp16/bf16), forward runs under
    ``torch.autocast(dtype)``; Linear/Conv parameters are all-reduced in that dtype
    (``get_comm_dtype``: their ``comm_dtype`` attribute), the others in their own fp32."""
    on = cf.get("torch_autocast.enabled")
    if on is None or not is_true(on.value):
        return False
    given = cf.get("torch_autocast.dtype")
    # get_torch_autocast_dtype: None when unset, and torch.autocast("cuda", dtype=None) runs float16
    dt = (dtype_of(given.value) if given is not None else None) or "float16"
    src = (on, given) if given is not None else (on,)
    fp32 = "the engine does not convert the module under torch_autocast"
    put("weights", Traced("float32", (on,), fp32))
    put("compute", Traced(dt, src, "torch.autocast(dtype) around the forward"))
    put("gradients", Traced("float32", (on,), "gradients follow the fp32 weights"))
    put("optimizer_state", Traced("float32", (on,), "optimizer state follows the fp32 weights"))
    put("master", Traced("none", (on,), "the fp32 weights are the master copy"))
    put("state_scheme", Traced("f32", (on,), "a plain optimizer over fp32 weights"))
    put("reduce", Traced(dt, src, "Linear/Conv parameters all-reduce in the autocast dtype (comm_dtype), others fp32"))
    put("loss_scaling", Traced("dynamic" if dt == "float16" else "none", src, "GradScaler for fp16 autocast only"))
    return True


def contribute(cf: ConfigFile, put: Any, auto: Auto) -> None:
    fp16, fp16_src = enabled(cf, "fp16.enabled", auto)
    bf16, bf16_src = enabled(cf, "bf16.enabled", auto)
    steps = cf.get("gradient_accumulation_steps")
    if steps is not None and isinstance(steps.value, int) and not isinstance(steps.value, bool):
        put("accumulate_steps", Traced(str(steps.value), (steps,), "micro-batches per optimizer step"))
    if fp16 and bf16:
        return  # contradictory: CW202 reports it; the run does not start, there is no model
    if not (fp16 or bf16) and _autocast(cf, put):
        put("device", Traced("cuda", (), "DeepSpeed trains on accelerators"), weak=True)
        return
    if fp16 or bf16:
        dt, src = ("float16", fp16_src) if fp16 else ("bfloat16", bf16_src)
        master, state, state_src = _master(cf, dt, src)
        put("weights", Traced(dt, src, "the DeepSpeed engine converts the module to this dtype"))
        put("compute", Traced(dt, src, "the module runs in its weights' dtype"))
        note = "ZeRO / DeepSpeed's fp16 and bf16 optimizers keep the state over the master copy"
        put("optimizer_state", Traced(state, state_src, note))
        put("master", Traced(master, state_src, "base_optimizer._configure_master_weights"))
        put("state_scheme", Traced({"float32": "f32", "bfloat16": "bf16"}.get(state, state), state_src, note))
        put("rounding", Traced("none", (), "DeepSpeed's optimizers round to nearest"))
        acc = cf.get("data_types.grad_accum_dtype")
        acc_dt = dtype_of(acc.value) if acc is not None else None
        if acc is not None and acc_dt is not None:
            put(
                "gradients",
                Traced(acc_dt, (acc,), "DeepSpeed accumulates gradients in grad_accum_dtype"),
                mechanism="accumulate",
            )
        else:
            # engine.get_data_types: without grad_accum_dtype gradients accumulate in the model dtype
            put("gradients", Traced(dt, src, "gradients follow the weights"))
        comm = cf.get("communication_data_type")
        comm_dt = dtype_of(comm.value) if comm is not None else None
        if comm is not None and comm_dt is not None:
            put("reduce", Traced(comm_dt, (comm,), "communication_data_type"))
        else:
            put("reduce", Traced(dt, src, "DeepSpeed communicates in the model's dtype by default"))
        if fp16:
            ls = cf.get("fp16.loss_scale")
            scale = ls.value if ls is not None else 0
            src_ls = (ls,) if ls else fp16_src
            if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0:
                put("loss_scaling", Traced(f"static:{scale:g}", src_ls, "fp16.loss_scale > 0 is a static scale"))
            else:
                put("loss_scaling", Traced("dynamic", src_ls, "fp16.loss_scale 0 (default): dynamic"))
        else:
            put("loss_scaling", Traced("none", bf16_src, "bf16 needs no loss scaling"))
    put("device", Traced("cuda", (), "DeepSpeed trains on accelerators"), weak=True)
