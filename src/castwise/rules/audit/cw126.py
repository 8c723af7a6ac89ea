"""CW126 module-outside-its-shard-unit: a module of an FSDP unit runs before the unit's own forward."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW126",
    name="module-outside-its-shard-unit",
    category=None,
    severity="error",
    summary="A module of an FSDP unit runs, called from outside, before the unit's own forward.",
    detects=(
        "In the audit of a model sharded by FSDP2 or wrapped by FSDP1 (or a castwise.fsdp2 plan), a "
        "module whose parameters belong to a unit runs in a forward pass before that unit's own "
        "forward has: another module called it directly."
    ),
    why=(
        "FSDP gathers a unit's parameters in its pre-forward hook, and only there. Before it, the "
        "module meets its shards: FSDP1's flat f32 views ('mat1 and mat2 must have the same dtype', "
        "or a shape error), FSDP2's DTensors ('got mixed torch.Tensor and DTensor'). The unsharded "
        "model runs, so the bug shows only once sharded."
    ),
    example=(
        "# DiT's forward: the first block's embedding, called from the root\n"
        "conditioning = self.transformer_blocks[0].norm1.emb(timestep, class_labels)\n"
        "# transformer_blocks.0 is an FSDP unit: its parameters are not gathered yet"
    ),
    fix=(
        "Make the called module a unit of its own, so its own pre-forward gathers it "
        "(fully_shard(model.transformer_blocks[0].norm1.emb) before its block; FSDP1: add its class to "
        "the auto-wrap policy)."
    ),
)

RULE = AuditRule(META)
