"""Accelerate's config file (``accelerate config`` -> default_config.yaml).

Semantics (huggingface/accelerate utils/dataclasses.py, accelerator.py, commands/config):
- ``mixed_precision`` (no, fp16, bf16, fp8): autocast in that dtype (bf16 for fp8, which adds
  float8 GEMMs: castwise's ``fp8`` preset); the model's weights are not cast (they stay as
  the script loaded them); fp16 adds a GradScaler (ShardedGradScaler
  under FSDP). fp16 on a CPU device is refused by Accelerator ("fp16 mixed precision requires a
  GPU") or, in newer versions, runs without a scaler.
- ``deepspeed_config.deepspeed_config_file``: a DeepSpeed JSON. DeepSpeedPlugin
  .set_mixed_precision raises when mixed_precision is fp16/bf16 and the file enables the other
  dtype ("`--mixed_precision` arg cannot be set to ... when ... is set in the DeepSpeed config
  file"); "auto" values are filled from mixed_precision; an explicit ``enabled: false`` is not
  overridden (fill_match(..., must_match=False)).
- ``fsdp_config``: FullyShardedDataParallelPlugin.set_mixed_precision builds
  MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype) from
  mixed_precision: gradients are reduced in the low dtype.
- ``use_cpu: true`` / ``distributed_type: MULTI_CPU``: the run is on CPU;
  ``compute_environment: AMAZON_SAGEMAKER`` with ``ec2_instance_type`` names the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from castwise.lint._source import Document, Path_
from castwise.lint.model import ConfigFile, Setting, Traced, is_scalar, is_true
from castwise.policy import presets

KEYS: dict[str, Path_] = {
    "mixed_precision": ("mixed_precision",),
    "distributed_type": ("distributed_type",),
    "use_cpu": ("use_cpu",),
    "compute_environment": ("compute_environment",),
    "ec2_instance_type": ("ec2_instance_type",),
    "deepspeed_config_file": ("deepspeed_config", "deepspeed_config_file"),
    "zero_stage": ("deepspeed_config", "zero_stage"),
    "fsdp_sharding_strategy": ("fsdp_config", "fsdp_sharding_strategy"),
    "fsdp_offload_params": ("fsdp_config", "fsdp_offload_params"),
    "fsdp_version": ("fsdp_config", "fsdp_version"),
    "fsdp_reshard_after_forward": ("fsdp_config", "fsdp_reshard_after_forward"),
    "fsdp_forward_prefetch": ("fsdp_config", "fsdp_forward_prefetch"),
}
MARKERS: frozenset[str] = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "deepspeed_config",
        "fsdp_config",
        "machine_rank",
        "num_machines",
        "main_training_function",
        "rdzv_backend",
        "same_network",
        "tpu_env",
    }
)

# SageMaker instance families -> GPU (AWS instance type documentation)
SAGEMAKER_GPUS: dict[str, str] = {
    "ml.p2": "K80",
    "ml.p3": "V100",
    "ml.p3dn": "V100",
    "ml.g3": "M60",
    "ml.g4dn": "T4",
    "ml.g5": "A10G",
    "ml.g6": "L4",
    "ml.g6e": "L40S",
    "ml.p4d": "A100",
    "ml.p4de": "A100",
    "ml.p5": "H100",
    "ml.p5e": "H200",
}


def is_accelerate_mapping(data: dict[str, Any]) -> bool:
    return any(k in data for k in MARKERS)


def read(doc: Document, shown: str, base: Path, load_link: Callable[[Path, str, Setting], ConfigFile]) -> ConfigFile:
    settings: dict[str, Setting] = {}
    rejected: dict[str, Setting] = {}
    for key, path in KEYS.items():
        node = doc.at(path)
        if key == "mixed_precision" and node is False:
            node = "no"  # unquoted `no` is YAML 1.1 false
        if is_scalar(node):
            settings[key] = Setting(".".join(str(p) for p in path), node, shown, doc.line(path))
        elif node is not None and key in ("mixed_precision", "use_cpu"):
            rejected[key] = Setting(".".join(str(p) for p in path), node, shown, doc.line(path))
    fp8 = doc.data.get("fp8_config")
    if isinstance(fp8, dict):
        # every key as written: lint_fp8_recipes checks which ones accelerate launch passes on
        for k, v in fp8.items():
            path = ("fp8_config", str(k))
            s = Setting(".".join(path), v, shown, doc.line(path))
            (settings if is_scalar(v) or isinstance(v, list) else rejected)[f"fp8_config.{k}"] = s
    for block in ("fsdp_config", "deepspeed_config"):
        # a non-empty engine section: lint_fsdp checks it is for the engine distributed_type picks
        if isinstance(doc.data.get(block), dict) and doc.data[block]:
            settings[f"{block}.block"] = Setting(block, "{...}", shown, doc.line((block,)))
    links: tuple[ConfigFile, ...] = ()
    ds = settings.get("deepspeed_config_file")
    if ds is not None and isinstance(ds.value, str) and ds.value.strip() and ds.value.strip().lower() != "none":
        # resolved relative to the config's folder, so a config and its DeepSpeed file travel together
        target = Path(ds.value.strip()).expanduser()
        candidate = target if target.is_absolute() else base / target
        if not candidate.exists() and not target.is_absolute() and target.exists():
            candidate = target
        links = (load_link(candidate, str(candidate), ds),)
    return ConfigFile(shown, "accelerate", settings, links, rejected=rejected)


def device(cf: ConfigFile) -> Traced | None:
    use_cpu = cf.get("use_cpu")
    dist = cf.get("distributed_type")
    if use_cpu is not None and is_true(use_cpu.value):
        return Traced("cpu", (use_cpu,), "use_cpu: the run is on CPU")
    if dist is not None and str(dist.value).upper() == "MULTI_CPU":
        return Traced("cpu", (dist,), "MULTI_CPU distributed training")
    ec2 = cf.get("ec2_instance_type")
    if ec2 is not None and isinstance(ec2.value, str):
        family = ec2.value.strip().lower().rsplit(".", 1)[0]
        gpu = SAGEMAKER_GPUS.get(family)
        if gpu is not None:
            return Traced(f"cuda:{gpu}", (ec2,), f"SageMaker {ec2.value} has {gpu} GPUs")
    if dist is not None and str(dist.value).upper() in ("XLA", "TPU"):
        return Traced("xla", (dist,), "XLA / TPU")
    if dist is not None and str(dist.value).upper() in ("MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM"):
        return Traced("cuda", (dist,), "GPU distributed training")
    return None


def mixed_precision(cf: ConfigFile) -> tuple[str | None, Setting | None]:
    s = cf.get("mixed_precision")
    if s is None:
        return None, None
    value = str(s.value).strip().lower()
    return value, s


def compute_and_scaling(mixed_precision: str) -> tuple[str, str]:
    """The matmul dtype and loss scaling of an Accelerate ``mixed_precision`` value, from castwise's
    presets: no/fp16/bf16 autocast; fp8 is bf16 autocast with float8 GEMMs (its Linears take
    float8_e4m3fn inputs), no GradScaler; unknown values do not autocast."""
    preset = presets.accelerate(mixed_precision)
    if preset is not None:
        return preset.gemm, preset.loss_scaling
    return "float32", "none"


def contribute(cf: ConfigFile, put: Any) -> None:
    mp, s = mixed_precision(cf)
    if mp is not None and s is not None:
        compute, scaling = compute_and_scaling(mp)
        put("compute", Traced(compute, (s,), "Accelerate autocasts the forward pass to mixed_precision"))
        put("loss_scaling", Traced(scaling, (s,), "Accelerate adds a GradScaler for fp16 only"))
        put("weights", Traced("float32", (), "Accelerate does not cast the model's weights"), weak=True)
        put("gradients", Traced("float32", (), "gradients follow the float32 weights"), weak=True)
        put("optimizer_state", Traced("float32", (), "optimizer state follows the float32 weights"), weak=True)
        dist = cf.get("distributed_type")
        if dist is not None and str(dist.value).upper() == "FSDP" and mp in ("fp16", "bf16"):
            put("reduce", Traced(compute, (s, dist), "FSDP MixedPrecision(reduce_dtype=mixed_precision dtype)"))
    dev = device(cf)
    if dev is not None:
        put("device", dev)
