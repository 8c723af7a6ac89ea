"""CW181 fp4-or-mx-unsupported-on-gpu: a block-scaled recipe (NVFP4, MXFP4, MX) the GPU class lacks."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Session
from castwise.rules.audit._base import AuditRule, Check, Diag

if TYPE_CHECKING:
    from castwise.rules.api import Ctx, FixContext

META = Rule(
    code="CW181",
    name="fp4-or-mx-unsupported-on-gpu",
    category="DTYPE_UNSUPPORTED_ON_DEVICE",
    severity="error",
    summary="The target GPU has no kernel for the policy's block-scaled recipe (NVFP4, MXFP4, MX), or "
    "an MX GEMM's reduction dim is not a multiple its kernels take.",
    detects="A policy with fp8=nvfp4 audited for a GPU without NVFP4 GEMMs (anything before Blackwell, "
    "and AMD: cuda:h200, cuda:mi300x, cuda:mi355x), fp8=mxfp4 for one without MX (Hopper, MI300X); "
    "and an MX block-scaled GEMM whose reduction dim is not a multiple of the class's (128 on an "
    "MI355X's hipBLASLt through TransformerEngine).",
    why="NVFP4 (E2M1 in 16-element blocks with E4M3 scales) is NVIDIA Blackwell's format (sm_100, "
    "sm_120); MX formats need Blackwell or AMD's gfx950. The recipe is refused when the first "
    "converted layer runs, after the job was scheduled.",
    example="castwise.audit(model, x, policy='bf16-mixed,fp8=nvfp4', device='cuda:h200')",
    fix="On that GPU use a recipe it runs (fp8=tensorwise on Hopper and MI300X, fp8=mxfp8 on an "
    "MI355X), or audit for, and run on, a GPU with it (cuda:gb200, cuda:sm120).",
)


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind != "mx-shape":
        return None
    fix = "Leave that layer out of the MX recipe (castwise.apply's filter), or pad its in-features."
    message = f"{ctx.at} is an MX GEMM the {ctx.device.name} kernel refuses: {ctx.text}"
    diag = ctx.diag("CW181", message, fix, origin=None, source=None)
    return dataclasses.replace(diag, details=(("gpu", ctx.device.name),))


def _scan(session: Session) -> list[Finding]:
    """The policy's recipe against the GPU class, whatever ran (CW132 says plain float8 and MXFP8)."""
    recipe = getattr(session.policy, "float8", None)
    device = session.runs[0].device if session.runs else None
    if recipe is None or device is None or device.kernels != "cuda" or recipe.scaling not in ("nvfp4", "mxfp4"):
        return []
    lacks = device.low_precision().missing(recipe.scaling)
    if lacks is None:
        return []
    message = f"policy {session.policy} trains fp8={recipe}, which needs {lacks}: {device.name} has none"
    fix = META.fix
    modes = tuple(r.mode for r in session.runs)
    has_fp8 = device.low_precision().missing("tensorwise") is None
    details = (("gpu", device.name), ("recipe", str(recipe)), ("gpu_has_fp8", has_fp8))
    return [Finding("CW181", message, module="", modes=modes, fix=fix, details=details)]


def _another_recipe(policy: Any, finding: Finding, fx: FixContext) -> Any:
    """A GPU with float8: tensorwise float8 GEMMs in place of the 4-bit ones; else the base precision."""
    recipe = getattr(policy, "float8", None)
    if recipe is None or finding.module:
        return policy
    if dict(finding.details).get("gpu_has_fp8"):
        return policy.replace(float8=dataclasses.replace(recipe, scaling="tensorwise", format=None))
    return policy.replace(float8=None)


RULE = AuditRule(META, checks=(Check("CW181", _match),), scan=_scan, policy_fix=_another_recipe)
