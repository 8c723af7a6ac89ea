"""CW123 policy-rule-matches-nothing: a policy rule selects no module of the model."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule

# found by the audit session (unmatched_rule_findings), which checks the policy's selectors
# against the model's module names (not against a run)
META = Rule(
    code="CW123",
    name="policy-rule-matches-nothing",
    category=None,
    severity="warning",
    summary="A keep[...] or out[...] rule of the policy matches no module of the model.",
    detects="A user's module rule whose selector selects no module: a glob whose `*` stands "
    "for one dotted segment where the module sits deeper (`keep[*.mlp]=f32` on a "
    "Llama, whose MLPs are `model.layers.0.mlp`), a misspelt name, a class the model "
    "does not use. The finding names the selector that would match.",
    why="The policy silently runs without the rule: the audit then checks another policy "
    "than the one written, and a clean report says nothing about the island or cast "
    "the user asked for. `castwise.apply` warns for the same reason.",
    example="castwise.audit(llama, inputs, policy='bf16-true,keep[*.mlp]=f32')\n"
    "# model.layers.0.mlp is two segments below '*': the rule selects nothing",
    fix="Use the suggested selector: `**` spans any number of segments (`keep[**.mlp]=f32`), "
    "or name the path with one `*` per segment (`keep[model.layers.*.mlp]=f32`).",
)

RULE = AuditRule(META)
