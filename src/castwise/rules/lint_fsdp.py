"""Rules lint-config reports for FSDP / FSDP2 settings (CW210+): Accelerate's ``fsdp_config``."""

from __future__ import annotations

from castwise.rules._rule import Rule

RULES: tuple[Rule, ...] = (
    Rule(
        code="CW210",
        name="engine-settings-ignored",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="warning",
        summary="FSDP or DeepSpeed settings that the chosen distributed_type never reads.",
        detects="An Accelerate config with a non-empty fsdp_config while distributed_type is not FSDP, "
        "or with a deepspeed_config while distributed_type is FSDP. Accelerate builds the FSDP "
        "plugin only for distributed_type FSDP and the DeepSpeed plugin only for DEEPSPEED.",
        why="The ignored section is where the run's precision was meant to come from: under FSDP, "
        "mixed_precision becomes FSDP's MixedPrecisionPolicy (weights gathered and gradients "
        "reduced in bf16/fp16); under DeepSpeed, its fp16/bf16 blocks convert the module and keep "
        "fp32 master weights. With the other engine the run trains with other dtypes (and another "
        "memory footprint) than the file shows, and nothing says so.",
        example="distributed_type: MULTI_GPU\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_reshard_after_forward: true",
        fix="Set distributed_type to the engine whose section you want (FSDP for fsdp_config, "
        "DEEPSPEED for deepspeed_config), or delete the section that does not apply.",
    ),
    Rule(
        code="CW211",
        name="fsdp2-refuses-fsdp1-settings",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="error",
        summary="fsdp_version 2 with FSDP1-only values that Accelerate refuses at start.",
        detects="An Accelerate fsdp_config with fsdp_version: 2 and fsdp_reshard_after_forward written "
        "as an FSDP1 sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD...) "
        "instead of true/false, or fsdp_forward_prefetch: true.",
        why="FullyShardedDataParallelPlugin refuses both when the processes start, after the job was "
        "scheduled: a strategy name is not a boolean for FSDP2 ('reshard_after_forward set to ... "
        "This is not supported with FSDP2, please set to a `bool`' or an invalid truth value), and "
        "'forward_prefetch is not yet implemented in FSDP2'. Configs converted from FSDP1 keep both.",
        example="distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_reshard_after_forward: FULL_SHARD",
        fix="Under fsdp_version 2 write fsdp_reshard_after_forward: true (FULL_SHARD) or false "
        "(SHARD_GRAD_OP), and drop fsdp_forward_prefetch; or set fsdp_version: 1.",
    ),
)
