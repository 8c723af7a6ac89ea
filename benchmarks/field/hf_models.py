"""Hugging Face transformers causal LMs from configs (no download), as a fine-tuning script builds
them; gradient checkpointing is model.gradient_checkpointing_enable()."""

import sys

import torch
from harness import hf_causal_lm, study

which = sys.argv[1]
recipes = sys.argv[2].split(",") if len(sys.argv) > 2 else None


def build(gc: bool = False) -> torch.nn.Module:
    return hf_causal_lm(which, gc)


ids = torch.randint(0, 128, (2, 16))
study(
    f"HF {which}",
    build,
    {"input_ids": ids, "labels": ids},
    recipes=recipes,
    build_gc=lambda: build(True),
    dynamic_once=(which == "llama"),
)
