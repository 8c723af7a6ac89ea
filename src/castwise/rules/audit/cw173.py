"""CW173 fp8-amax-on-tp-shard: a Float8 TP style makes torchao take the amax of the TP-local shard."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW173",
    name="fp8-amax-on-tp-shard",
    category=None,
    severity="warning",
    summary="A Float8Linear's float8 amax is taken on its TP-local shard instead of over the TP group.",
    detects=(
        "In the audit of a tensor-parallel model, a torchao Float8Linear sharded with a Float8 TP style "
        "(Float8ColwiseParallel, Float8RowwiseParallel) with use_local_output=False, so its output stays a "
        "DTensor."
    ),
    why=(
        "torchao's Float8 TP styles compute the per-tensor amax after to_local(): with use_local_output=True "
        "(the default) that is the whole tensor the next op sees; with use_local_output=False the amax is the "
        "TP-local shard's, not the TP group's, so each rank scales with its own amax. torchtitan#3109: after "
        "torchtitan set use_local_output=False on its Colwise layers, FP8 with TP>=2 spiked the gradient norm "
        "at step 2 and gave NaN loss from step 3. A GPU-only failure, documented, not reproduced here."
    ),
    example="parallelize_module(m, tp_mesh, {'w1': Float8ColwiseParallel(use_local_output=False)})",
    fix=(
        "Keep use_local_output=True on Float8 TP styles, or use the plain ColwiseParallel/RowwiseParallel "
        "(float8 GEMMs with high-precision TP collectives, amax reduced by DTensor)."
    ),
)

RULE = AuditRule(META)
