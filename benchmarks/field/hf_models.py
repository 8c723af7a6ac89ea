"""Hugging Face transformers causal LMs from configs (no download), as a fine-tuning script builds
them; gradient checkpointing is model.gradient_checkpointing_enable()."""

import sys

import torch
import transformers
from harness import study

which = sys.argv[1]
recipes = sys.argv[2].split(",") if len(sys.argv) > 2 else None
small = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **small),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **small),
}


def build(gc: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = CONFIGS[which]()
    cfg._attn_implementation = "sdpa"
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    if gc:
        m.gradient_checkpointing_enable()
    return m


ids = torch.randint(0, 128, (2, 16))
study(
    f"HF {which}",
    build,
    {"input_ids": ids, "labels": ids},
    recipes=recipes,
    build_gc=lambda: build(True),
    dynamic_once=(which == "llama"),
)
