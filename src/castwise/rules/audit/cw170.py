"""CW170 tp-shard-breaks-lowp-gemm: a GEMM dim valid unsharded is invalid on its TP-local shard."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW170",
    name="tp-shard-breaks-lowp-gemm",
    category=None,
    severity="error",
    summary="A Linear's dims suit float8 / MX GEMMs unsharded, but not its tensor-parallel shard.",
    detects=(
        "In the audit of a tensor-parallel plan (DTensor parallelize_module, with FSDP2 or alone) under "
        "a float8 or MX policy, a Linear whose global weight dims are multiples of what the low-precision "
        "GEMM needs (16 for torch._scaled_mm's float8, 32 for an MX block; NVFP4 and hipBLASLt need "
        "128) while the local shard a rank multiplies is not: ColwiseParallel divides out_features by "
        "the TP degree, RowwiseParallel in_features."
    ),
    why=(
        "Float8 conversion filters (torchao's, torchtitan's filter_fqns, castwise's own) look at the "
        "module before parallelize_module, so the layer is converted; each rank then calls "
        "torch._scaled_mm on its local shard, which refuses dims that are not multiples of 16 "
        "('Expected both dimensions of mat2 to be divisble by 16'), on every rank, once the job runs on "
        "GPUs. One GPU (or a smaller TP degree) runs the same model."
    ),
    example=(
        "# up: Linear(4096, 11008); TP8 shards it to (1376, 4096): fine. TP16: 688 rows, fine;\n"
        "# Linear(64, 208) under TP8: (26, 64): 26 is not a multiple of 16"
    ),
    fix=(
        "Pick a TP degree that divides the dim into multiples of 16 (32 for MX), pad the dim "
        "(torchao Float8LinearConfig(pad_inner_dim=True), or a larger hidden size), or leave the layer "
        "out of the float8 conversion (torchtitan filter_fqns, castwise keep[...]=bf16)."
    ),
)

RULE = AuditRule(META)
