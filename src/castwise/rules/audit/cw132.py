"""CW132 fp8-unsupported-on-gpu: the target GPU has no float8 (or MX) GEMMs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Session
from castwise.rules.audit._base import AuditRule, Check, Diag

if TYPE_CHECKING:
    from castwise.devices import Device
    from castwise.rules.api import Ctx, FixContext

META = Rule(
    code="CW132",
    name="fp8-unsupported-on-gpu",
    category="DTYPE_UNSUPPORTED_ON_DEVICE",
    severity="error",
    summary="The target GPU has no float8 (or MX) GEMMs.",
    detects="A float8 matmul (torch._scaled_mm) audited for a GPU below compute capability 8.9 "
    "(cuda:a100, cuda:t4, cuda:v100), an MX block-scaled one (float8_e8m0fnu scales: mxfp8) below "
    "10.0 (anything before Blackwell: cuda, cuda:l4), or two e5m2 operands (no such cuBLASLt GEMM); "
    "and a policy's float8 recipe such a GPU cannot run, even where no float8 GEMM ran (every Linear "
    "left out by apply's filter, or not reached).",
    why="float8 GEMMs run on FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) or newer; MX formats on "
    "Blackwell (sm_100). On an A100 the first float8 Linear fails in _scaled_mm ('torch._scaled_mm is "
    "only supported on CUDA devices with compute capability >= 9.0 or 8.9'), after the job was "
    "scheduled.",
    example="castwise.audit(model, x, policy='fp8', device='cuda:a100')",
    fix="On that GPU train in bf16 (bf16-mixed) instead of fp8; for MX formats before Blackwell use "
    "fp8 with tensorwise or rowwise scaling; or audit for, and run on, a GPU that has them "
    "(cuda:l4, cuda (H100-class), cuda:b200).",
)


def _verdict(kernel: str, device: Device) -> tuple[str, str, tuple[tuple[str, object], ...]]:
    """The GPU as messages name it, the fix, and the details, for a ``kernel`` it refuses."""
    sm = device.capability
    on = f"{device.name} (compute capability {sm[0]}.{sm[1]})" if sm else device.name
    has_fp8 = sm is not None and device.runs_float8()
    if kernel == "e5m2":
        fix = "Cast one operand to e4m3: a hybrid recipe (e4m3 forward, e5m2 gradients) never multiplies two e5m2."
    elif kernel == "mx" and has_fp8:
        fix = f"Use fp8 with tensorwise or rowwise scaling on {on} (policy fp8); MX formats need Blackwell (cuda:b200)."
    else:
        fix = f"Train in bf16 on {on} (policy bf16-mixed), or target a GPU with FP8 (cuda:l4, cuda, cuda:b200)."
    return on, fix, (("fp8_kernel", kernel), ("gpu_has_fp8", has_fp8))


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind != "fp8-device":
        return None
    mx = any("e8m0" in str(d) for d in ctx.dtypes)  # E8M0 block scales: the operands say MX, not the message
    # the contract's order: the GPU's compute capability first, then two e5m2 operands
    on, fix, details = _verdict("e5m2" if ctx.device.runs_float8(mx) else "mx" if mx else "fp8", ctx.device)
    diag = ctx.diag("CW132", f"{ctx.at} is a float8 GEMM {on} cannot run: {ctx.text}", fix, origin=None, source=None)
    return dataclasses.replace(diag, details=details)


NEEDS = {
    "mx": "MX block-scaled float8 GEMMs (compute capability 10.0, Blackwell)",
    "fp8": "float8 GEMMs (FP8 tensor cores: compute capability 8.9 or 9.0+)",
    "e5m2": "GEMMs of two e5m2 operands (no cuBLASLt kernel has them)",
}


def _scan(session: Session) -> list[Finding]:
    """The policy's recipe against the GPU, whatever ran: with every Linear left out by apply's
    filter (or not reached) no float8 GEMM ran for the check above to see. Once: not beside it."""
    recipe = getattr(session.policy, "float8", None)
    device = session.runs[0].device if session.runs else None
    if recipe is None or device is None or device.kernels != "cuda" or any(f.code == "CW132" for f in session.findings):
        return []
    mx = recipe.scaling == "mxfp8"
    kernel = ("mx" if mx else "fp8") if not device.runs_float8(mx) else "e5m2" if recipe.format == "e5m2" else None
    if kernel is None:
        return []
    on, fix, details = _verdict(kernel, device)
    message = (
        f"policy {session.policy} trains fp8={recipe}, which needs {NEEDS[kernel]}: {on} cannot run it "
        "(found from the recipe and the GPU: none of its float8 GEMMs ran in this audit)"
    )
    modes = tuple(r.mode for r in session.runs)
    return [Finding("CW132", message, module="", modes=modes, fix=fix, details=(*details, ("recipe", str(recipe))))]


def _another_recipe(policy: Any, finding: Finding, fx: FixContext) -> Any:
    """MX on a GPU with plain FP8: tensorwise float8; no FP8 at all: the base precision."""
    recipe = getattr(policy, "float8", None)
    if recipe is None:
        return policy
    details = dict(finding.details)
    if details.get("fp8_kernel") == "mx" and details.get("gpu_has_fp8"):
        return policy.replace(float8=dataclasses.replace(recipe, scaling="tensorwise"))
    return policy.replace(float8=None)


RULE = AuditRule(META, checks=(Check("CW132", _match),), scan=_scan, policy_fix=_another_recipe)
