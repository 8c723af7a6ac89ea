"""CW180 fp8-flavour-on-gpu: float8 GEMM operands in a flavour the target GPU has no kernel for."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule, Check, Diag

if TYPE_CHECKING:
    from castwise.rules.api import Ctx

META = Rule(
    code="CW180",
    name="fp8-flavour-on-gpu",
    category="DTYPE_UNSUPPORTED_ON_DEVICE",
    severity="error",
    summary="A float8 GEMM's operands are in a float8 flavour the target GPU's kernels do not take.",
    detects="A float8 matmul (torch._scaled_mm) audited for a GPU class whose float8 GEMMs take one "
    "flavour only: OCP float8_e4m3fn / float8_e5m2 operands on an AMD MI300X (cuda:mi300x, whose "
    "hipBLASLt float8 GEMMs are FNUZ: float8_e4m3fnuz / float8_e5m2fnuz), or FNUZ operands on a GPU "
    "with OCP float8 (cuda:mi355x, NVIDIA).",
    why="The two flavours differ in bias, largest value (e4m3fn 448, e4m3fnuz 240), NaN and negative "
    "zero: MI300 (gfx942) implements FNUZ only, MI355 (gfx950) and NVIDIA OCP only. Code that hard-"
    "codes torch.float8_e4m3fn (a hand-written float8 recipe, a checkpoint's scales) fails on the "
    "first GEMM of the other vendor's GPU, after the job was scheduled.",
    example="a = x.to(torch.float8_e4m3fn)  # on an MI300X\ntorch._scaled_mm(a, w_t, scale_a, scale_b)",
    fix="Take the float8 dtype from the platform (torchao.float8.config.e4m3_dtype picks "
    "float8_e4m3fnuz on MI300), or audit for, and run on, a GPU with that flavour.",
)


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind != "fp8-flavour":
        return None
    fix = (
        f"Cast to the float8 flavour {ctx.device.name} takes (torchao.float8.config.e4m3_dtype picks it per "
        "platform), or audit for the GPU this code was written for."
    )
    message = f"{ctx.at} is a float8 GEMM whose operands {ctx.device.name} has no kernel for: {ctx.text}"
    diag = ctx.diag("CW180", message, fix, origin=None, source=None)
    return dataclasses.replace(diag, details=(("gpu", ctx.device.name),))


RULE = AuditRule(META, checks=(Check("CW180", _match),))
