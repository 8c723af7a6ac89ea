"""CW172 fsdp2-input-cast-narrows-position-table: cast_forward_inputs rounds an f32 position table."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW172",
    name="fsdp2-input-cast-narrows-position-table",
    category=None,
    severity="warning",
    summary="An FSDP2 unit's input cast narrows an f32 position / phase table passed to its forward.",
    detects=(
        "In the audit of an FSDP2 model (or plan), a unit whose MixedPrecisionPolicy casts forward inputs "
        "(cast_forward_inputs=True, the default, with param_dtype bf16 or f16) receives a floating f32 tensor "
        "passed as a position or phase table (a forward argument named like freqs, rope, rotary, position, "
        "pos, phase, theta, angle, cos/sin)."
    ),
    why=(
        "FSDP2's pre-forward hook casts every floating tensor in the unit's args and kwargs to param_dtype "
        "(FSDPState._cast_forward_inputs), not only the activations. A RoPE table or float position tensor "
        "computed in f32 by the caller reaches the unit in bf16, which keeps 8 significant bits: position 257 "
        "becomes 256 and the angles of long sequences are rounded, so attention degrades with context length "
        "without any error. Integer and complex tensors are not cast."
    ),
    example=(
        "fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))\n"
        "h = layer(h, freqs)  # freqs: f32 (seq, dim/2) angles, received as bf16"
    ),
    fix=(
        "Pass the positions as an integer tensor or the table as complex, build the table inside the unit "
        "from an f32 buffer, or shard the unit with MixedPrecisionPolicy(cast_forward_inputs=False) and cast "
        "the activations yourself."
    ),
)

RULE = AuditRule(META)
