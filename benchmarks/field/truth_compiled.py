"""Real Inductor compiles on this CPU (forward + backward, then eval) for the recipes whose audit
was most at risk: GPT-2 16-mixed (the graph break inside apply's autocast block), timm resnet18
bf16-true (batch norm in bf16), HF llama bf16-mixed with gradient checkpointing."""

import sys

import timm
import torch
import transformers
from harness import Autocast, truth_row

which = sys.argv[1]
if which == "gpt2":
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    cfg._attn_implementation = "sdpa"
    ids = torch.randint(0, 128, (2, 16))

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg)

    truth_row("HF gpt2", "16-mixed", build, {"input_ids": ids, "labels": ids}, "16-mixed", compiled=True)
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
    small = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_key_value_heads=2,
    )

    def build_gc() -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**small)
        cfg._attn_implementation = "sdpa"
        m = transformers.AutoModelForCausalLM.from_config(cfg)
        m.gradient_checkpointing_enable()
        return m

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
