"""Policy fixes several audit rules share (torch imported when a fix is computed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from castwise.rules.audit._text import generalize

if TYPE_CHECKING:
    from castwise.auditor.context import FixContext
    from castwise.report import Finding


def keep_module_fix(policy: Any, finding: Finding, fx: FixContext) -> Any:
    """Make the failing module a float32 island (and norms float32 under a *-true policy)."""
    import torch

    if policy.norms is None and not policy.is_mixed and policy.compute_dtype in (torch.float16, torch.bfloat16):
        policy = policy.replace(norms=torch.float32)
    fx.add(generalize(finding.module or ""), torch.float32, "keep")
    return policy


def out_fix(policy: Any, finding: Finding, fx: FixContext) -> Any:
    """Cast the culprit modules' outputs to the compute dtype."""
    for m in fx.culprits(finding):
        fx.add(generalize(m), fx.compute, "out")
    return policy
