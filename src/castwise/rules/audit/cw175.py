"""CW175 collective-dtype-mismatch: a collective's tensors differ in dtype, within a call or across its ranks."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW175",
    name="collective-dtype-mismatch",
    category=None,
    severity="error",
    summary="A collective (an MoE all-to-all, a reduce) runs with tensors of different dtypes.",
    detects=(
        "In the per-program audit of an expert- or pipeline-parallel mesh, a c10d collective a program makes "
        "(all-to-all dispatch/combine, all-gather, reduce-scatter, all-reduce) whose operands differ in dtype in "
        "one call, or that the programs of its group run in different dtypes (experts kept in f32 on one EP rank)."
    ),
    why=(
        "torch.distributed refuses a call whose tensors differ in dtype (c10d's all_to_all_single: 'Invalid usage "
        "of tensors with different dtypes'; gloo's reduce_scatter: 'Check failed: outputTensors[i].dtype() == "
        "inputTensors[i].dtype()'). Across ranks nothing checks: each rank sends its own bytes, so a rank whose "
        "experts return f32 while the others return bf16 makes the group exchange tensors of different sizes or "
        "read each other's bits as the wrong dtype. A rank-0 audit never sees the other ranks' programs."
    ),
    example=(
        "experts = build_experts(ep_rank)  # rank 3 forgot .to(torch.bfloat16)\n"
        "dist.all_to_all_single(out, experts(x), group=ep_group)"
    ),
    fix=(
        "Keep the modules feeding the collective in one dtype on every rank of the group and allocate output "
        "buffers in the input's dtype (torch.empty_like(x)); cast after the collective if another dtype is needed."
    ),
)

RULE = AuditRule(META)
