"""CW131 fp8-gemm-shape: a float8 GEMM gets a dimension that is not a multiple of 16."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._text import where

if TYPE_CHECKING:
    from castwise.rules.api import Ctx

META = Rule(
    code="CW131",
    name="fp8-gemm-shape",
    category="DTYPE_UNSUPPORTED_ON_DEVICE",
    severity="error",
    summary="A float8 GEMM gets a dimension that is not a multiple of 16.",
    detects="A float8 matmul (torch._scaled_mm: torchao's Float8Linear, Accelerate's and torchtitan's "
    "float8 recipes) on a simulated CUDA device whose operands have a dimension that is not a multiple "
    "of 16: in forward a Linear's in or out features, in backward the batch's token count (batch x "
    "sequence), which only the weight-gradient GEMM (grad_out.t() @ input) multiplies over.",
    why="cuBLASLt's float8 GEMMs need every dimension divisible by 16, and _scaled_mm refuses the "
    "call ('Expected trailing dimension of mat1 to be divisible by 16'). The token count is the "
    "surprise (pytorch/ao issue 3111): the forward runs, the first backward fails, on the GPU, after "
    "the job was scheduled; a last batch of another size fails hours into training.",
    example="convert_to_float8_training(model)  # on an H100\n"
    "model(torch.randn(2, 7, 64)).sum().backward()  # 14 tokens: the weight gradient's GEMM refuses",
    fix="Tokens: pad each batch to a multiple of 16 tokens (pad_to_multiple_of=16 in the collator, "
    "drop_last=True for the loader). Features: leave the layer out of float8 (castwise.apply's filter "
    "does; torchao: module_filter_fn; torchtitan: filter_fqns), or pad it (Float8LinearConfig("
    "pad_inner_dim=True)); or train that run in another recipe (bf16-mixed).",
)


def _match(ctx: Ctx) -> Diag | None:
    if ctx.kind != "fp8-shape":
        return None
    tokens = ctx.phase == "backward"  # forward checks every weight dim: what fails after is the tokens
    if tokens:
        what = (
            "the weight gradient's GEMM multiplies over the batch's tokens (batch x sequence), whose count "
            "is not a multiple of 16 (the forward ran: its GEMMs take only the layer's features)"
        )
        fix = (
            "Pad each batch to a multiple of 16 tokens (pad_to_multiple_of=16 in the collator; "
            "drop_last=True so no short last batch comes), or train in another recipe (bf16-mixed)."
        )
    else:
        what = "the layer's in or out features are not a multiple of 16"
        fix = (
            f"Leave {where(ctx.module)} out of float8 (castwise.apply's fp8 filter does by itself; torchao: "
            "module_filter_fn; torchtitan: filter_fqns), or pad it: Float8LinearConfig(pad_inner_dim=True)."
        )
    message = f"{ctx.at} is a float8 GEMM the {ctx.device.label} kernel refuses: {what}: {ctx.text}"
    diag = ctx.diag("CW131", message, fix, origin=None, source=None)
    return dataclasses.replace(diag, details=(("gemm_dim", "tokens" if tokens else "features"),))


RULE = AuditRule(META, checks=(Check("CW131", _match),))
