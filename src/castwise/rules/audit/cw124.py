"""CW124 grad-scaler-half-params: trainable f16 parameters under loss scaling: GradScaler.unscale_ refuses them."""

from __future__ import annotations

from typing import Any

from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Origin, Session
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW124",
    name="grad-scaler-half-params",
    category="GRADSCALER_LOW_PRECISION_PARAMS",
    severity="error",
    summary="Trainable parameters are f16 under loss scaling: GradScaler.unscale_ refuses their gradients.",
    detects="The policy scales the loss (16-mixed, Accelerate's fp16, a GradScaler the script made) "
    "while parameters that require grad are float16 (a `model.half()` of the model being "
    "trained): their gradients are float16 too. Frozen parameters (requires_grad=False, "
    "a VAE or text encoder kept in f16 for speed) are not reported.",
    why="GradScaler.unscale_ (called by scaler.step, or by the script before clipping) raises "
    "'Attempting to unscale FP16 gradients.' at the first optimizer step: the forward and "
    "backward of the first step run, then training stops. Loss scaling is meant for float32 "
    "master weights with f16 compute.",
    example="unet.half(); scaler = torch.amp.GradScaler()\n"
    "with torch.autocast('cuda', dtype=torch.float16): loss = unet(...).sample.pow(2).mean()\n"
    "scaler.scale(loss).backward(); scaler.step(opt)  # ValueError: Attempting to unscale FP16 gradients.",
    fix="Keep the trained model's parameters in float32 (no `.half()` / `.to(torch.float16)` on it; "
    "autocast computes in f16 all the same); frozen models may stay f16. If f16 weights are meant, "
    "train without the GradScaler (`16-true`, or `16-true,master_weights=on`).",
)


def _owner(names: list[str]) -> str:
    """The innermost module that holds every one of ``names`` (dotted parameter names)."""
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for segs in zip(*parts, strict=False):
        if any(s != segs[0] for s in segs):
            break
        common.append(segs[0])
    return ".".join(common)


def half_trainable(model: Any) -> list[str]:
    """The names of ``model``'s float16 parameters that require grad."""
    import torch

    return [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]


def _scan(session: Session) -> list[Finding]:
    policy, runs = session.policy, session.runs
    if policy is None or policy.loss_scale is None or policy.master_weights or not runs:
        return []
    names = half_trainable(runs[0].copy)
    if not names:
        return []
    owner = _owner(names)
    sample = ", ".join(f"`{n}`" for n in names[:3]) + (", ..." if len(names) > 3 else "")
    where = f"`{owner}`" if owner else "the model"
    return [
        Finding(
            code="CW124",
            module=owner,
            origin=Origin(owner or None, None, f"param {names[0]}"),
            modes=tuple(r.mode for r in runs if r.mode == "train") or tuple(r.mode for r in runs),
            message=(
                f"{len(names)} trainable param(s) of {where} are f16 ({sample}) under policy {policy}, "
                f"which scales the loss ({policy.loss_scale}): their gradients are f16, and "
                "GradScaler.unscale_ refuses them ('Attempting to unscale FP16 gradients.') at the "
                "first optimizer step, after the first forward and backward have run."
            ),
            fix=(
                f"Keep {where}'s trainable parameters in float32: drop the `.half()` / "
                "`.to(torch.float16)` on the model you train (autocast computes in f16 all the same; "
                "frozen models may stay f16), or train without the GradScaler if f16 weights are "
                "meant (`16-true`, or `16-true,master_weights=on`)."
            ),
        )
    ]


RULE = AuditRule(META, scan=_scan)
