"""The FSDP checks of lint-config (CW210+, pages in castwise/rules/lint_fsdp.py).

Semantics (huggingface/accelerate commands/launch.py ``_validate_launch_command``,
utils/launch.py ``prepare_multi_gpu_env``, utils/dataclasses.py ``FullyShardedDataParallelPlugin``):
- the FSDP plugin is built only for ``distributed_type: FSDP``, the DeepSpeed plugin only for
  ``DEEPSPEED``; the other section of the file is not read;
- ``fsdp_version: 2`` takes ``fsdp_reshard_after_forward`` as a boolean (``str_to_bool``) and refuses
  FSDP1's strategy names and ``forward_prefetch`` ("not yet implemented in FSDP2");
- mixed_precision becomes the FSDP plugin's MixedPrecision(Policy) with param and reduce dtype
  both mixed_precision's (the precision model's ``reduce``: castwise/lint/accelerate.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from castwise.lint.model import ConfigFile, finding, is_true, said
from castwise.report import Finding

FSDP1_STRATEGIES: frozenset[str] = frozenset(
    {
        "FULL_SHARD",
        "SHARD_GRAD_OP",
        "NO_SHARD",
        "HYBRID_SHARD",
        "HYBRID_SHARD_ZERO2",
        "1",
        "2",
        "3",
        "4",
        "5",
    }
)


def _cw210(cf: ConfigFile) -> list[Finding]:
    dist = cf.get("distributed_type")
    if dist is None:
        return []
    kind = str(dist.value).strip().upper()
    fsdp, ds = cf.get("fsdp_config.block"), cf.get("deepspeed_config.block")
    out = []
    if fsdp is not None and kind != "FSDP":
        out.append(
            finding(
                "CW210",
                (dist, fsdp),
                f"{said((dist,))}, but the file also has an fsdp_config ({fsdp.location}): Accelerate builds "
                "the FSDP plugin only for distributed_type FSDP, so the model is not sharded and FSDP's mixed "
                "precision (weights gathered and gradients reduced in mixed_precision's dtype) never applies.",
                f"Set {dist.name} to FSDP to use the fsdp_config, or delete fsdp_config.",
            )
        )
    if ds is not None and kind == "FSDP":
        out.append(
            finding(
                "CW210",
                (dist, ds),
                f"{said((dist,))}, but the file also has a deepspeed_config ({ds.location}): Accelerate builds "
                "the DeepSpeed plugin only for distributed_type DEEPSPEED, so its fp16/bf16 settings (module "
                "conversion, fp32 master weights, loss scaling) never apply.",
                f"Set {dist.name} to DEEPSPEED to use the deepspeed_config, or delete deepspeed_config.",
            )
        )
    return out


def _cw211(cf: ConfigFile) -> list[Finding]:
    dist, version = cf.get("distributed_type"), cf.get("fsdp_version")
    if dist is None or str(dist.value).strip().upper() != "FSDP" or version is None:
        return []
    if str(version.value).strip() != "2":
        return []
    out = []
    reshard = cf.get("fsdp_reshard_after_forward")
    if (
        reshard is not None
        and not isinstance(reshard.value, bool)
        and str(reshard.value).strip().upper() in FSDP1_STRATEGIES
    ):
        out.append(
            finding(
                "CW211",
                (version, reshard),
                f"{said((version, reshard))}: FSDP2 takes reshard_after_forward as true/false, and "
                f"FullyShardedDataParallelPlugin refuses the FSDP1 strategy name {reshard.text} when the processes "
                "start.",
                f"Set {reshard.name} to true (FULL_SHARD) or false (SHARD_GRAD_OP), or set {version.name} to 1.",
            )
        )
    prefetch = cf.get("fsdp_forward_prefetch")
    if prefetch is not None and is_true(prefetch.value):
        out.append(
            finding(
                "CW211",
                (version, prefetch),
                f"{said((version, prefetch))}: Accelerate raises 'forward_prefetch is not yet implemented in FSDP2' "
                "when the processes start.",
                f"Remove {prefetch.name} (or set it to false), or set {version.name} to 1.",
            )
        )
    return out


def run_checks(files: Sequence[ConfigFile]) -> list[Finding]:
    out: list[Finding] = []
    for cf in files:
        if cf.format == "accelerate":
            out += [*_cw210(cf), *_cw211(cf)]
    return out
