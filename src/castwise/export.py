"""A castwise policy as the precision settings of DeepSpeed, Accelerate, Lightning, torchtitan and
Megatron-Bridge.

>>> castwise.export.deepspeed("bf16-mixed")
{'fp16': {'enabled': False}, 'bf16': {'enabled': True}, 'communication_data_type': 'fp32'}
>>> castwise.export.accelerate("bf16-mixed,reduce=bf16")["fsdp_config"]["fsdp_version"]
2
>>> castwise.export.lightning("bf16-mixed")
{'precision': 'bf16-mixed'}
>>> castwise.export.torchtitan("fp8")["model"]
{'converters': ['quantize.linear.float8']}

Each result is what the library's own configuration says (a DeepSpeed config's precision
section, keys of Accelerate's default_config.yaml with its ``fsdp_config`` and ``fp8_config``,
Lightning Trainer arguments, the sections of a torchtitan job TOML), lints clean with ``castwise
lint-config`` once written to a file, and parses with the library's own config classes.
Engines can say less than a policy: module rules (fp32 islands, ``norms``,
``_keep_in_fp32_modules``), cast-back and fast-path handling are not configuration settings
anywhere, and each engine fixes some dtypes itself (DeepSpeed keeps fp32 master weights and
converts the whole module; Accelerate's FSDP reduces gradients in ``mixed_precision``'s dtype).
What a target cannot say raises ``ExportError`` with ``strict=True``; by default it is left to
the script and named in an ``ExportWarning``: apply the rest there with ``castwise.apply`` or
``castwise.fsdp2.fully_shard``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from castwise import _export_fp8 as _fp8
from castwise._dtypes import name_of, short_of
from castwise.errors import ExportError

if TYPE_CHECKING:
    from castwise.policy import Policy

__all__ = ["ExportError", "ExportWarning", "accelerate", "deepspeed", "lightning", "megatron_bridge", "torchtitan"]

_DS_NAME = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class ExportWarning(UserWarning):
    """Part of a policy is left to the training script: the target's configuration cannot say it."""


def _policy(policy: Policy | str) -> Policy:
    from castwise.policy import Policy

    return Policy.parse(policy)


def _script_only(policy: Policy, target: str) -> list[str]:
    """Parts of ``policy`` no configuration file expresses (they live in the training script)."""
    out = [f"module rule {r}" for r in policy.rules]
    if policy.norms is not None:
        out.append(f"norms={short_of(policy.norms)} (normalisation layers as islands)")
    if not policy.fastpath:
        out.append("fastpath=off")
    if policy.default_dtype is not None:
        out.append(f"default_dtype={short_of(policy.default_dtype)} (torch's default dtype while the model runs)")
    if policy.float8 is not None and target == "DeepSpeed":
        # DeepSpeed has no float8 setting: exporting only the base would train another precision
        out.append(f"fp8={policy.float8} (float8 GEMMs: DeepSpeed's config has no FP8 setting)")
    return out


def _left_out(target: str, parts: list[str], strict: bool, fix: str) -> None:
    if not parts:
        return
    what = "; ".join(sorted(parts))
    if strict:
        raise ExportError(f"{target}'s configuration cannot say: {what}. {fix}")
    warnings.warn(
        f"castwise.export.{target.lower()}: left to the training script: {what}. {fix}", ExportWarning, stacklevel=3
    )


def _check_dtypes(policy: Policy, target: str) -> None:
    import torch

    if policy.compute_dtype == torch.float64 or policy.param_dtype == torch.float64:
        raise ExportError(
            f"{target} trains in f32, bf16 or f16; this policy computes in {short_of(policy.compute_dtype)}. "
            "valid compute dtypes: bf16, f16, f32"
        )


def deepspeed(policy: Policy | str, *, strict: bool = False) -> dict[str, Any]:
    """The precision section of a DeepSpeed config for ``policy``.

    bf16/f16 compute enables DeepSpeed's ``bf16``/``fp16`` mode, which converts the module to
    that dtype and keeps f32 master weights in the optimizer (under ``*-mixed`` and ``*-true``
    alike); f16 gets dynamic loss scaling (``loss_scale: 0``) unless the policy fixes a scale.
    The policy's ``reduce`` dtype is ``communication_data_type``.
    """
    import torch

    p = _policy(policy)
    _check_dtypes(p, "DeepSpeed")
    out: dict[str, Any] = {"fp16": {"enabled": False}, "bf16": {"enabled": False}}
    if p.compute_dtype == torch.bfloat16:
        out["bf16"] = {"enabled": True}
    elif p.compute_dtype == torch.float16:
        scale = p.loss_scale if isinstance(p.loss_scale, float) else 0
        out["fp16"] = {"enabled": True, "loss_scale": scale, "initial_scale_power": 16}
    out["communication_data_type"] = _DS_NAME[name_of(p.reduce_dtype)]
    left = _script_only(p, "DeepSpeed")
    _left_out(
        "DeepSpeed",
        left,
        strict,
        "Apply them to the module before deepspeed.initialize (castwise.apply), knowing the engine "
        "converts the whole module to its dtype.",
    )
    return out


def accelerate(policy: Policy | str, *, fsdp: bool = True, strict: bool = False) -> dict[str, Any]:
    """Keys of Accelerate's config file (default_config.yaml) for ``policy``.

    ``mixed_precision`` is the policy's compute dtype under autocast (``no`` for f32, and for
    ``*-true`` policies: their weights are loaded in the low dtype by the script, and autocast
    would add nothing). With ``fsdp=True`` (the default) ``distributed_type: FSDP`` and the FSDP
    plugin's ``fsdp_config`` for FSDP2 (transformer-block wrapping, reshard after forward, sharded
    state dicts); ``fsdp=False``: ``MULTI_GPU`` (DDP, gradients all-reduced in the weights' dtype).
    Accelerate's FSDP plugin gathers and reduces in ``mixed_precision``'s dtype: a policy whose
    ``reduce`` dtype differs is left to the script (``FullyShardedDataParallelPlugin(
    mixed_precision_policy=...)`` or ``castwise.fsdp2.fully_shard``).
    """
    import torch

    p = _policy(policy)
    _check_dtypes(p, "Accelerate")
    mp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(p.compute_dtype, "no") if p.is_mixed else "no"
    out: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": mp}
    left = _script_only(p, "Accelerate")
    if p.float8 is not None:
        config, fp8_left = _fp8.accelerate(p, fsdp)
        left += fp8_left
        if config is not None:
            out["mixed_precision"] = "fp8"
            out["fp8_config"] = config
    if not p.is_mixed and p.param_dtype != torch.float32:
        left.append(f"{short_of(p.param_dtype)} weights (load the model with torch_dtype={short_of(p.param_dtype)})")
    if fsdp:
        out["distributed_type"] = "FSDP"
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": False,
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,
        }
        gathered = p.compute_dtype if p.is_mixed else p.param_dtype
        if p.reduce_dtype != gathered:
            left.append(f"reduce={short_of(p.reduce_dtype)} (Accelerate's FSDP reduces in {short_of(gathered)})")
    else:
        out["distributed_type"] = "MULTI_GPU"
        grads = p.param_dtype  # DDP all-reduces gradients in the parameters' dtype
        if p.reduce_dtype != grads:
            left.append(f"reduce={short_of(p.reduce_dtype)} (DDP all-reduces gradients in {short_of(grads)})")
    _left_out(
        "Accelerate",
        left,
        strict,
        "Apply them in the script: castwise.apply(model, policy) before accelerator.prepare, or "
        "castwise.fsdp2.fully_shard for FSDP2.",
    )
    return out


def lightning(policy: Policy | str, *, strict: bool = False) -> dict[str, Any]:
    """Lightning ``Trainer`` arguments for ``policy``; under LightningCLI they go in the ``trainer:``
    section. The ``precision`` string says everything Lightning's precision plugins can: no policy
    needs a ``plugins`` entry (a plugin with ``precision`` would be refused: CW205). A static loss
    scale has no Lightning plugin (its GradScaler always grows and backs off): left to the script.

    ``*-mixed`` policies are Lightning's MixedPrecision; f32 and f64 its ``32-true``/``64-true``;
    castwise's ``pure_bf16``/``pure_fp16`` are Lightning's ``bf16-true``/``16-true`` (the whole module
    converted: castwise's own ``bf16-true`` adds f32 norm islands, left to the script).
    """
    import torch

    p = _policy(policy)
    low = {torch.bfloat16: "bf16", torch.float16: "16"}
    if p.is_mixed:
        precision = f"{low[p.compute_dtype]}-mixed"
    elif p.compute_dtype in low:
        precision = f"{low[p.compute_dtype]}-true"
    else:
        precision = "64-true" if p.compute_dtype == torch.float64 else "32-true"
    left = _script_only(p, "Lightning")
    own_default = p.default_dtype is not None and p.float8 is None
    if p.float8 is not None:
        precision, fp8_left, own_default = _fp8.lightning(p, precision)
        left += fp8_left
    if own_default and _policy(precision if p.float8 else f"lightning:{precision}").default_dtype == p.default_dtype:
        # Lightning's *-true set it around each step themselves
        left = [x for x in left if not x.startswith("default_dtype=")]
    if p.compute_dtype == torch.float16 and p.is_mixed and p.loss_scale is None:
        left.append("loss_scale=none (Lightning's 16-mixed always scales the loss)")
    if isinstance(p.loss_scale, float):
        left.append(f"loss_scale={p.loss_scale:g} (16-mixed scales dynamically)")
    if p.reduce_dtype != torch.float32 and p.reduce_dtype != p.param_dtype:
        left.append(f"reduce={short_of(p.reduce_dtype)} (DDP reduces in the parameters' dtype)")
    _left_out(
        "Lightning",
        left,
        strict,
        "Apply them in configure_model (castwise.apply, or castwise.fsdp2.fully_shard under "
        "ModelParallelStrategy), or use castwise.lightning.CastwiseCallback(fix=True).",
    )
    return {"precision": precision}


def torchtitan(policy: Policy | str, *, model: Any = None, fsdp: bool = True, strict: bool = False) -> dict[str, Any]:
    """The sections of a torchtitan job TOML for ``policy``: ``[training]``'s FSDP2 mixed precision
    (``mixed_precision_param``/``mixed_precision_reduce``), and for a float8 recipe the model
    converter (``[model] converters``) with its ``[quantize.linear.float8]`` (tensorwise, rowwise)
    or ``[quantize.linear.mx]`` (mxfp8) section. ``filter_fqns`` names the Linears to leave out:
    castwise's filter over ``model`` when one is given (``castwise.float8.convert``), else
    torchtitan's default (``output``) plus the policy's ``keep[...]`` names.
    """
    p = _policy(policy)
    _check_dtypes(p, "torchtitan")
    out, left = _fp8.torchtitan(p, model, fsdp)
    left += [x for x in _script_only(p, "torchtitan") if not x.startswith("module rule keep[") or p.float8 is None]
    _left_out(
        "torchtitan",
        left,
        strict,
        "Apply them where the job builds its model (a model converter, or castwise.apply before "
        "parallelize), or train another recipe torchtitan's settings can say.",
    )
    return out


def megatron_bridge(policy: Policy | str, *, strict: bool = False) -> dict[str, Any]:
    """Megatron-Bridge's ``mixed_precision`` recipe name for ``policy`` (``ConfigContainer(
    mixed_precision=NAME)``): the recipe that means the policy's precision and GEMM recipe
    (``castwise.policy.vocab.BRIDGE``); module rules are left to the script. ExportError naming the
    recipes when none means it (Bridge's recipes are Megatron's --bf16 / --fp16 with a recipe)."""
    from castwise.policy import Policy
    from castwise.policy.vocab import BRIDGE

    p = _policy(policy)
    bare = p.replace(rules=())
    names = [name for name, clauses in BRIDGE.items() if Policy.parse(clauses) == bare]
    if not names:
        raise ExportError(
            f"no Megatron-Bridge recipe means {bare}; valid: "
            + ", ".join(f"{n} ({Policy.parse(c)})" for n, c in sorted(BRIDGE.items()))
        )
    left = [f"module rule {r}" for r in p.rules]
    _left_out("Megatron-Bridge", left, strict, "Apply them where the recipe builds its model (castwise.apply).")
    return {"mixed_precision": min(names, key=len)}
