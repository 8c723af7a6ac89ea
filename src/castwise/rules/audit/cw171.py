"""CW171 fp8-all-gather-uneven-shard: torchao's float8 all-gather of a parameter FSDP2 shards unevenly."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW171",
    name="fp8-all-gather-uneven-shard",
    category=None,
    severity="error",
    summary="A weight all-gathered in float8 by FSDP2 has a sharded dim that does not divide by the world size.",
    detects=(
        "In the audit of an FSDP2 model converted by torchao with Float8LinearConfig("
        "enable_fsdp_float8_all_gather=True) (its Float8Linear weights are WeightWithDynamicFloat8CastTensor), "
        "a weight whose sharded dim (dim 0 unless shard_placement_fn says otherwise) is not a multiple of the "
        "FSDP2 shard group's size."
    ),
    why=(
        "FSDP2 shards dim 0 with torch.chunk and pads the last ranks' shards to the largest one. torchao's "
        "fsdp_pre_all_gather (torchao/float8/fsdp_utils.py) casts each rank's padded local shard to float8 and "
        "fsdp_post_all_gather rebuilds the weight from the gathered float8 data: with uneven shards this fails "
        "or yields a wrong weight (torchao#3982). The same model all-gathered in bf16, or sharded over a world "
        "size dividing the dim, runs."
    ),
    example=(
        "convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))\n"
        "fully_shard(m, mesh=dp16)  # Linear(64, 200): 200 rows over 16 ranks"
    ),
    fix=(
        "Make the sharded dim a multiple of the shard group (pad the layer or pick a dividing world size), leave "
        "the layer out of float8 (module_filter_fn), or all-gather it in high precision "
        "(enable_fsdp_float8_all_gather=False)."
    ),
)

RULE = AuditRule(META)
