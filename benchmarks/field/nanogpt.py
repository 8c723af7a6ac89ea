"""nanoGPT (karpathy/nanoGPT model.py) at toy size, audited compiled as train.py compiles it."""

import sys

import torch

sys.path.insert(0, "/tmp/field_ext/nanoGPT")
from harness import study
from model import GPT, GPTConfig

torch.manual_seed(0)
cfg = GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
idx = torch.randint(0, 128, (2, 16))
tgt = torch.randint(0, 128, (2, 16))


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


recipes = sys.argv[1].split(",") if len(sys.argv) > 1 else None
study("nanoGPT", build, (idx, tgt), recipes=recipes, truth_compiled=("bf16-mixed",))
