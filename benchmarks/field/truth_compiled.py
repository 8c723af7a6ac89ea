"""Real Inductor compiles on this CPU (forward + backward, then eval) for the recipes whose audit
was most at risk: GPT-2 16-mixed (the graph break inside apply's autocast block), timm resnet18
bf16-true (batch norm in bf16), HF llama bf16-mixed with gradient checkpointing."""

import sys

import timm
import torch
from harness import Autocast, hf_causal_lm, truth_row

which = sys.argv[1]
if which == "gpt2":
    ids = torch.randint(0, 128, (2, 16))
    truth_row(
        "HF gpt2",
        "16-mixed",
        lambda: hf_causal_lm("gpt2"),
        {"input_ids": ids, "labels": ids},
        "16-mixed",
        compiled=True,
    )
elif which == "resnet":
    truth_row(
        "timm resnet18",
        "bf16-true",
        lambda: timm.create_model("resnet18", num_classes=10),
        torch.randn(2, 3, 32, 32),
        "bf16-true",
        compiled=True,
    )
elif which == "llama":

    def build_gc() -> torch.nn.Module:
        return hf_causal_lm("llama", gc=True)

    ids = torch.randint(0, 128, (2, 16))
    truth_row(
        "HF llama", "bf16-mixed+grad-ckpt", build_gc, {"input_ids": ids, "labels": ids}, "bf16-mixed", compiled=True
    )
    truth_row(
        "HF llama",
        "own-autocast-bf16",
        lambda: Autocast(build_gc(), "cpu"),
        {"input_ids": ids, "labels": ids},
        None,
        compiled=True,
    )
