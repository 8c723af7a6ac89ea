"""A GPT pretrained with Lightning Fabric in the style of litgpt's pretrain.py (written for
castwise's tests: a tiny model, CPU, random tokens): ``fabric.init_module``, ``fabric.setup``, a
validation sanity check under no_grad before training, the FLOPs measured on a meta-device copy
(``measure_flops``), gradient accumulation under ``fabric.no_backward_sync`` and
``fabric.backward``, gradient clipping. ``--precision`` is Fabric's.

``--upcast-norm`` plants a bug that only Lightning's ``bf16-true`` meets: the final norm is a
LayerNorm run on ``x.float()`` with its own weights, which Fabric's conversion made bf16 (the
CPU kernel refuses f32 inputs with bf16 weights); castwise's own ``bf16-true`` keeps norms in f32.
"""

import argparse

import lightning as L
import torch
from lightning.fabric.utilities.throughput import measure_flops
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--precision", default="bf16-mixed")
p.add_argument("--iters", type=int, default=4)
p.add_argument("--upcast-norm", action="store_true")
args = p.parse_args()


class RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        return (x * torch.rsqrt(norm_x + self.eps)).to(dtype) * self.weight


class UpcastLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.float()).type_as(x)


def build_rope_cache(seq_len, n_elem, device=None, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=device).float() / n_elem))
    seq_idx = torch.arange(seq_len, device=device).float()
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1, x2 = x[..., : head_size // 2], x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class Attention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head = n_head

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.fc_1 = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.fc_2 = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.proj(nn.functional.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.norm_1, self.attn = RMSNorm(n_embd), Attention(n_embd, n_head)
        self.norm_2, self.mlp = RMSNorm(n_embd), MLP(n_embd)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, n_embd=32, n_head=4, n_layer=2, block_size=16):
        super().__init__()
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        ln_f = UpcastLayerNorm(n_embd) if args.upcast_norm else RMSNorm(n_embd)
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, n_embd), h=blocks, ln_f=ln_f))
        self.n_head, self.n_embd = n_head, n_embd
        self.max_seq_length = block_size

    @property
    def max_seq_length(self):
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value):
        self._max_seq_length = value
        cos, sin = build_rope_cache(value, self.n_embd // self.n_head, device=self.lm_head.weight.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        T = idx.size(1)
        if self.max_seq_length < T:
            raise ValueError(f"Cannot forward sequence of length {T}, max seq length is only {self.max_seq_length}.")
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


def chunked_cross_entropy(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


fabric = L.Fabric(accelerator="cpu", devices=1, precision=args.precision)
fabric.seed_everything(42)
with fabric.init_module(empty_init=False):
    model = GPT()
model = fabric.setup(model)
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
data = torch.randint(0, 64, (8, 17))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=4))


@torch.no_grad()
def validate():
    model.eval()
    losses = []
    for batch in loader:
        logits = model(batch[:, :16].contiguous().long())
        losses.append(chunked_cross_entropy(logits, batch[:, 1:17].contiguous().long()))
    model.train()
    return torch.stack(losses).mean()


fabric.print(f"val {validate().item():.4f}")  # the sanity check before training
with torch.device("meta"):
    meta_model = GPT()
    x = torch.randint(0, 1, (4, meta_model.max_seq_length))
    flops = measure_flops(meta_model, lambda: meta_model(x), lambda y: chunked_cross_entropy(y, x))
fabric.print(f"flops {flops}")
for it in range(args.iters):
    batch = data[(it % 2) * 4 : (it % 2) * 4 + 4]
    with fabric.no_backward_sync(model, enabled=it % 2 == 0):
        logits = model(batch[:, :16].contiguous().long())
        loss = chunked_cross_entropy(logits, batch[:, 1:17].contiguous().long())
        fabric.backward(loss / 2)
    if it % 2:
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    fabric.print(f"iter {it} loss {loss.item():.4f}")
fabric.print("done")
