"""CW174 pipeline-recv-dtype-mismatch: a pipeline stage receives into a buffer of another dtype or shape."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW174",
    name="pipeline-recv-dtype-mismatch",
    category=None,
    severity="error",
    summary="A pipeline stage's receive buffer differs in dtype or shape from what the stage before sends.",
    detects=(
        "In the per-program audit of a pipeline (a list of PipelineStages, one per pp coordinate), a stage whose "
        "declared input (PipelineStage input_args, from which its receive buffer is made) differs in dtype or "
        "shape from the output the previous stage computes under the audited dtypes."
    ),
    why=(
        "PipelineStage allocates each receive buffer from its input metadata and the schedule moves the sent "
        "tensor's bytes into it (batch_isend_irecv). With input_args and output_args both given (static "
        "metadata) nothing compares the dtypes (only TORCH_DISTRIBUTED_DEBUG=DETAIL does): a bf16 activation "
        "received into an f32 buffer is read as f32 bit patterns, so the later stages train on garbage without "
        "an error. With inferred metadata the receiving stage compares what it is sent with its input_args and "
        "raises PipeliningMetadataError at its first step (torch.distributed.pipelining.stage, "
        "_validate_inferred_metadata) while the other stages wait. Either way only the ranks of the receiving "
        "stage see it; a rank-0 audit audits stage 0."
    ),
    example=(
        "stage0 = PipelineStage(layers_0_7.to(torch.bfloat16), 0, 2, dev, input_args=x_bf16)\n"
        "stage1 = PipelineStage(layers_8_15, 1, 2, dev, input_args=torch.empty(mb, seq, dim))  # f32"
    ),
    fix=(
        "Declare the receiving stage's input_args in the dtype and shape the previous stage returns, or cast "
        "the previous stage's output to the receiver's dtype before it returns."
    ),
)

RULE = AuditRule(META)
