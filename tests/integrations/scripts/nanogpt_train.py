"""A GPT training script in the style of nanoGPT's train.py (written for castwise's tests: a
tiny model, CPU, random tokens). Settings are globals, overridden by ``--key=value`` arguments;
``ctx`` is the script's own autocast, the GradScaler is on for float16 only.

``--n_expert=2`` plants the bug: a mixture-of-experts MLP gathers its experts' outputs into a
``torch.zeros_like(x)`` buffer by index; under autocast the experts' outputs are bf16 and the
buffer float32, and index_put refuses to mix them at the first step.
"""

import math
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F

# -----------------------------------------------------------------------------
# default config values
batch_size = 2
block_size = 8
vocab_size = 32
n_layer = 2
n_head = 2
n_embd = 16
dropout = 0.0
learning_rate = 1e-3
max_iters = 2
dtype = "bfloat16"
n_expert = 0  # > 0: a mixture-of-experts MLP (the planted bug)
# -----------------------------------------------------------------------------
for arg in sys.argv[1:]:  # --key=value overrides, as a configurator would
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals():
        raise ValueError(f"Unknown config key: {key}")
    default = globals()[key]
    globals()[key] = type(default)(value) if not isinstance(default, str) else value


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(n_embd, n_expert, bias=False)
        self.experts = nn.ModuleList([nn.Linear(n_embd, n_embd) for _ in range(n_expert)])

    def forward(self, x):
        choice = self.router(x).argmax(dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            routed = choice == i
            out[routed] = expert(x[routed])
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        if n_expert:
            self.mlp = MoE()
        else:
            self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


torch.manual_seed(1337)
device_type = "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
model = GPT()
print(f"number of parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.4f}M")
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)


def get_batch():
    x = torch.randint(vocab_size, (batch_size, block_size))
    return x, torch.roll(x, -1, dims=1)


@torch.no_grad()
def estimate_loss():
    model.eval()
    X, Y = get_batch()
    with ctx:
        _, loss = model(X, Y)
    model.train()
    return loss.item()


for iter_num in range(max_iters):
    X, Y = get_batch()
    with ctx:
        logits, loss = model(X, Y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {iter_num}: loss {loss.item():.4f}")
print(f"val loss {estimate_loss():.4f}")
