"""CW175 collective-dtype-mismatch: a collective's tensors differ in dtype, within a call or across its ranks."""

from __future__ import annotations

import dataclasses
import re

from castwise._dtypes import canonical, short
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx
from castwise.rules.audit._base import AuditRule, Check, Diag

META = Rule(
    code="CW175",
    name="collective-dtype-mismatch",
    category=None,
    severity="error",
    summary="A collective (an MoE all-to-all, a reduce) runs with tensors of different dtypes.",
    detects=(
        "In the per-program audit of an expert- or pipeline-parallel mesh, a c10d collective a program makes "
        "(all-to-all dispatch/combine, all-gather, reduce-scatter, all-reduce) whose operands differ in dtype in "
        "one call, or that the programs of its group run in different dtypes (experts kept in f32 on one EP rank); "
        "in any audit, a collective that c10d's own check refuses for tensors of different dtypes (all_to_all_single "
        "raises before any op dispatches), such as an expert-parallel style's dispatch into a buffer of another dtype."
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

# c10d's own check (distributed_c10d.py: _ensure_all_tensors_same_dtype), raised before any op
# dispatches; the audit's text names the torch.distributed function it was raised in
_REFUSED = re.compile(r"different dtypes.*\(in torch\.distributed\.(\w+)\)", re.S)
_KINDS = (("all_to_all", "all-to-all"), ("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"))


def _match(ctx: Ctx) -> Diag | None:
    """A collective that c10d refused because its tensors differ in dtype (in any program: the
    same code runs on every rank of its group)."""
    found = _REFUSED.search(ctx.text)
    if found is None:
        return None
    call = found.group(1)
    kind = next((k for key, k in _KINDS if call.startswith(key)), call)
    words = re.findall(r"torch\.(\w+)", ctx.text)
    named = dict.fromkeys(short(name) for name in (canonical(w) for w in words) if name is not None)
    dtypes = " and ".join(named) or "two dtypes"
    diag = ctx.diag(
        "CW175",
        f"The {kind} in `{ctx.module or '(root)'}` (torch.distributed.{call}) is handed tensors in {dtypes}: "
        f"c10d refuses a collective whose tensors differ in dtype, on every rank of its group. Real error: {ctx.text}",
        f"Allocate the {kind}'s output buffer in the input's dtype (torch.empty_like(x)), cast after it.",
        origin=False,
        source=False,
    )
    return dataclasses.replace(diag, details=(("collective", kind), ("dtypes", list(named))))


# before every other check: the collective refused the call, whatever the tensors' provenance
RULE = AuditRule(META, checks=(Check("CW175", _match),), before="CW132")
