"""Policy fixes several audit rules share (torch imported when a fix is computed)."""

from __future__ import annotations

from typing import Any

from castwise._dtypes import is_low
from castwise.rules.api import Finding, FixContext
from castwise.rules.audit._text import generalize, is_ancestor


def selector_for(name: str, finding: Finding) -> str:
    """The selector of a float32 island at ``name``: generalized over repeated blocks
    (``layers.*.norm``) only when the finding shows at another instance of the same pattern too
    (a place or a culprit); a fault in one block gets an island in that block, and the others
    keep their low precision."""
    general = generalize(name)
    if general == name:
        return name
    details = dict(finding.details)
    seen = {finding.module or "", *details.get("also_at", ()), *details.get("culprit_modules", ())}
    return general if any(m != name and generalize(m) == general for m in seen) else name


def keep_module_fix(policy: Any, finding: Finding, fx: FixContext) -> Any:
    """Make the failing module a float32 island (and norms float32 under a *-true policy)."""
    import torch

    if policy.norms is None and not policy.is_mixed and is_low(policy.compute_dtype):
        policy = policy.replace(norms=torch.float32)
    fx.add(selector_for(finding.module or "", finding), torch.float32, "keep")
    return policy


def keep_culprits_fix(policy: Any, finding: Finding, fx: FixContext) -> Any:
    """Make each culprit module a float32 island."""
    import torch

    for m in fx.culprits(finding):
        fx.add(selector_for(m, finding), torch.float32, "keep")
    return policy


def out_fix(policy: Any, finding: Finding, fx: FixContext) -> Any:
    """Cast the culprit modules' outputs to the compute dtype; a culprit that contains the module
    where the finding shows (it upcasts for its own children) becomes a float32 island instead:
    casting its output back comes too late for the op inside it."""
    import torch

    at = finding.module or ""
    for m in fx.culprits(finding):
        if m != at and is_ancestor(m, at):
            fx.add(selector_for(m, finding), torch.float32, "keep")
        else:  # a cast to the compute dtype costs no low precision: every repeated block gets it
            fx.add(generalize(m), fx.compute, "out")
    return policy
