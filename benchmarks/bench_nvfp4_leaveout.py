"""NVFP4 leave-out per Linear: castwise's per-GEMM forecast and torchtitan's rule of thumb against
emulated NVFP4 truth.

    python benchmarks/bench_nvfp4_leaveout.py [--seeds 0,1] [--plants 2] [--recipe nvfp4|mxfp4] [--noise]

Models (built from configs, nothing downloaded): Llama, Mistral, Qwen2, GPT-NeoX, OPT, BERT, ViT
and a convnet with a Linear head, each small; per seed ``--plants`` operand distributions are
planted (bench_float8_leaveout's: an outlier element, row or column, columns spanning 10^-6..1, a
norm weight giving an outlier or wide channel).

Truth, per Linear: its input and grad_output captured from a float32 forward and backward; the
three GEMMs of the layer (output = x W^T, grad_input = g W, grad_weight = g^T x) run on NVFP4
operands (castwise.float8.fp4: bit for bit torchao's quantization; inputs in 1x16 blocks along the
reduction dim, round to nearest even, no Hadamard transform or stochastic rounding) in float64. A
layer is *bad* when one of its GEMMs loses over ``COLUMN_SHARE`` of its columns (a column's error
over the root-sum-square of its terms above ``score.threshold(recipe)``, the one per-format
threshold the audit's leave-out filter reads too: 0.5 for the 4-bit formats, float8's 0.3 raised
above E2M1's own rounding noise, which ``--noise`` measures on benign operands).

Forecast: ``castwise.float8.score.lost`` per GEMM, which never runs the whole GEMM: for the
4-bit formats it measures each result line's error through a 32-row random sign sketch of the
dim that error sums over (the identity when that dim is 32 or shorter), a layer flagged when a
GEMM's lost share of columns (rows too for grad_weight) is over ``COLUMN_SHARE``. Its mean-only
predecessor (independent terms' expected error) missed the lines that cross by chance (few
tokens) or coherently (a block's small values flushed together).
torchtitan's rule of thumb: the last ~15% of the transformer blocks and the
output head stay in bf16 (flagged), every other Linear is NVFP4.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_float8_leaveout import capture, convnet, plant, vit

from castwise.float8 import fp4, score
from castwise.policy.float8 import Float8Recipe

COLUMN_SHARE = 0.01
HEAD_NAMES = ("lm_head", "classifier", "embed_out", "score")
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, vocab_size=256)


def _causal(kind: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    cfg_cls, model_cls, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
        "opt": ("OPTConfig", "OPTForCausalLM", {}),
    }[kind]
    fields = dict(_TINY, tie_word_embeddings=False, **extra)
    if kind == "opt":
        fields = dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            vocab_size=256,
            word_embed_proj_dim=64,
            tie_word_embeddings=False,
        )
    model = getattr(tf, model_cls)(getattr(tf, cfg_cls)(**fields))
    ids = torch.randint(0, 256, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(**_TINY, num_labels=32))
    return model, {"input_ids": torch.randint(0, 256, (4, 16)), "labels": torch.randint(0, 32, (4,))}


MODELS: dict[str, Any] = {
    **{k: (lambda k=k: _causal(k)) for k in ("llama", "mistral", "qwen2", "gpt_neox", "opt")},
    "bert": bert,
    "vit": vit,
    "convnet": convnet,
}


def _gemms(x: torch.Tensor, g: torch.Tensor | None, w: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, A, B) of each GEMM ``A @ B`` of a Linear, the reduction dim last in A and first in B."""
    x = x.reshape(-1, x.shape[-1]).float()
    out = [("output", x, w.t().float())]
    if g is not None:
        g = g.reshape(-1, g.shape[-1]).float()
        out += [("grad_input", g, w.float()), ("grad_weight", g.t(), x)]
    return out


def _q(t: torch.Tensor, recipe: str) -> torch.Tensor:
    return fp4.nvfp4(t) if recipe == "nvfp4" else fp4.mxfp4(t)


def _column_errors(got: torch.Tensor, ref: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each live column's error of ``ref = a @ b`` in ``got`` over its terms' root-sum-square."""
    a, b = a.reshape(-1, a.shape[-1]).double(), b.double()
    scale = (a.square() @ b.square()).sqrt().norm(dim=0)
    err = (got - ref).norm(dim=0)
    live = scale > 0
    return err[live] / scale[live]


def _column_bad(got: torch.Tensor, ref: torch.Tensor, a: torch.Tensor, b: torch.Tensor, recipe: str) -> float:
    """The share of columns of ``ref = a @ b`` that ``got`` loses (bench_float8_leaveout's measure)."""
    ratios = _column_errors(got, ref, a, b)
    return float((ratios > score.threshold(recipe)).double().mean()) if ratios.numel() else 0.0


def truth(gemms: list[tuple[str, torch.Tensor, torch.Tensor]], recipe: str) -> bool:
    for name, a, b in gemms:
        got = _q(a.contiguous(), recipe).double() @ _q(b.t().contiguous(), recipe).t().double()
        ref = a.double() @ b.double()
        share = _column_bad(got, ref, a, b, recipe)
        if name == "grad_weight":
            share = max(share, _column_bad(got.t(), ref.t(), b.t(), a.t(), recipe))
        if share > COLUMN_SHARE:
            return True
    return False


def forecast(gemms: list[tuple[str, torch.Tensor, torch.Tensor]], recipe: str) -> bool:
    for name, a, b in gemms:
        got = score.shares(score.lost(a, b, recipe, ("", ""), rows=name == "grad_weight"))
        if max(got.get("lost_cols", 0.0), got.get("lost_rows", 0.0)) > COLUMN_SHARE:
            return True
    return False


def rule_of_thumb(names: list[str]) -> set[str]:
    """torchtitan's: the last ~15% of blocks (at least one) and the head."""
    block = re.compile(r"\.(?:layers|layer|h)\.(\d+)\.")
    index = {n: int(m.group(1)) for n in names if (m := block.search(f".{n}."))}
    n_blocks = max(index.values(), default=-1) + 1
    last = set(range(n_blocks - max(1, math.ceil(0.15 * n_blocks)), n_blocks))
    heads = {n for n in names if n.rsplit(".", 1)[-1] in HEAD_NAMES or n not in index}
    return {n for n, i in index.items() if i in last} | heads


def run(model_name: str, seed: int, plants: int, recipe: str) -> list[tuple[str, bool, bool, bool]]:
    torch.manual_seed(seed)
    model, inputs = MODELS[model_name]()
    plant(model, torch.Generator().manual_seed(seed), plants)
    got = capture(model, inputs)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n in got]
    thumb = rule_of_thumb(names)
    rows = []
    for n in names:
        w = model.get_submodule(n).weight.detach()
        gemms = _gemms(got[n]["input"], got[n].get("grad_output"), w)
        rows.append((f"{model_name}/{seed}/{n}", truth(gemms, recipe), forecast(gemms, recipe), n in thumb))
    return rows


def _pr(rows: list[tuple[str, bool, bool, bool]], col: int) -> str:
    tp = sum(r[1] and r[col] for r in rows)
    fp = sum(not r[1] and r[col] for r in rows)
    fn = sum(r[1] and not r[col] for r in rows)
    recall = tp / (tp + fn) if tp + fn else 1.0
    precision = tp / (tp + fp) if tp + fp else 1.0
    return f"recall {recall:6.1%} precision {precision:6.1%} (tp {tp}, fp {fp}, fn {fn})"


def noise(recipe: str) -> None:
    """The per-column error of the format's GEMMs on benign operands (no outlier planted): plain
    rounding, which the lost-column threshold must sit above."""
    g = torch.Generator().manual_seed(0)
    draws = {
        "normal": lambda *s: torch.randn(*s, generator=g),
        "student-t(3)": lambda *s: (
            torch.randn(*s, generator=g) / torch.randn(3, *s, generator=g).square().mean(0).sqrt()
        ),
        "log-normal": lambda *s: torch.randn(*s, generator=g).exp() * torch.randn(*s, generator=g).sign(),
    }
    for dist, draw in draws.items():
        ratios = []
        for m, k, n in ((32, 64, 64), (64, 128, 128), (128, 256, 64), (16, 512, 128), (256, 64, 256)):
            for _ in range(4):
                a, b = draw(m, k), draw(k, n)
                got = _q(a.contiguous(), recipe).double() @ _q(b.t().contiguous(), recipe).t().double()
                ratios.append(_column_errors(got, a.double() @ b.double(), a, b))
        r = torch.cat(ratios).float()
        q = torch.quantile(r, torch.tensor([0.5, 0.99, 0.999]))
        print(
            f"{recipe} rounding noise, {dist:12}: {r.numel()} columns, median {q[0]:.3f}, p99 {q[1]:.3f}, "
            f"p99.9 {q[2]:.3f}, max {r.max():.3f} (threshold {score.threshold(recipe)})"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--plants", type=int, default=2)
    ap.add_argument("--recipe", default="nvfp4", choices=("nvfp4", "mxfp4"))
    ap.add_argument("--noise", action="store_true", help="only the format's rounding noise on benign operands")
    args = ap.parse_args()
    Float8Recipe.parse(args.recipe)
    if args.noise:
        noise(args.recipe)
        return
    warnings.filterwarnings("ignore")
    rows: list[tuple[str, bool, bool, bool]] = []
    for name in MODELS:
        for seed in (int(s) for s in args.seeds.split(",")):
            got = run(name, seed, args.plants, args.recipe)
            rows += got
            print(f"{name:9} seed {seed}: {len(got):3} Linears, {sum(r[1] for r in got):3} bad in truth", flush=True)
    print(f"\n{args.recipe}: {len(rows)} Linears over {len(MODELS)} models, {sum(r[1] for r in rows)} bad in truth")
    print(f"castwise forecast (score.lost per GEMM): {_pr(rows, 2)}")
    print(f"torchtitan rule of thumb (last 15% + head): {_pr(rows, 3)}")


if __name__ == "__main__":
    main()
