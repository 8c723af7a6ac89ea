"""The float8 leave-out list (CW313) per recipe against real float8 runs of every Linear.

    python benchmarks/bench_float8_leaveout.py [--seeds 0,1,2] [--held-out 3,4,5] [--plants 3]

Cases: small models built from configs (Llama, ViT, a convnet with a Linear head; GPT-2 is left
out: its projections are transformers' Conv1D, which torchao does not convert), every Linear's
in/out features and token count multiples of 32 (so the numbers, not the shape rules, decide).
Per seed ``--plants`` sites are planted: a weight with one huge element, an outlier row or
column (10^3..10^7 x its absmax), a weight whose columns span 10^-6..1 (its layer's input
gradient, the grad_output of the layer before, spans it too), or a norm weight that gives the
next Linears' input an outlier channel or a channel range of 10^-6..1.

Truth, per recipe, per Linear, from a real float8 run of that layer: its input and grad_output
are captured from a float32 run of the model; the layer is converted by torchao 0.18 on the
CPU (``Float8Linear`` with ``emulate=True`` for tensorwise and rowwise: the float8 casts and
scales are torchao's own, the GEMM in float32; ``MXFP8TrainingOpConfig`` with
``KernelPreference.EMULATED`` for mxfp8) and run forward and backward on those tensors. A
layer is *bad* when some feature loses most of its signal: for output and grad_input (each
``A @ B``) a column, for grad_weight a column or a row, with an error ||float8 - f32|| over the
root-sum-square of its terms sqrt(A^2 @ B^2) (a column flushed whole gives about 1, float8
rounding about 0.05; a cancelling sum is not judged by its small result) over 0.3, in more
than 1% of the columns.

Forecast: ``castwise.forecast(model, inputs, target=T)`` with T = ``fp8`` (tensorwise),
``bf16-mixed,fp8=rowwise`` and ``mxfp8``; its ``summary["float8"]["leave_out"]``. The tuning
seeds also sweep the flushed-share threshold (the list recomputed from each layer's
``lost_share``, the GEMMs' part as shipped); the held-out seeds score the shipped threshold only.
Each group also scores the list's two numeric parts alone: the operands' lost lines and the
GEMMs' lost features (``castwise.float8.score``).

``--truth-device cuda`` (a GPU with float8 tensor cores, sm_89+): the tensorwise and rowwise truth
from torchao's real float8 kernels (``emulate=False``: ``torch._scaled_mm``; the layer in bf16, as
float8 training runs, and the only output type the rowwise kernel gives), mxfp8's from real
kernels only on sm_100+ (emulated below); the forecast is scored against that truth, and how
often the emulated truth agrees with the real one is printed per recipe.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import castwise
from castwise.numerics import float8_leaveout as f8l

RECIPES = {"tensorwise": "fp8", "rowwise": "bf16-mixed,fp8=rowwise", "mxfp8": "mxfp8"}
COLUMN_ERROR = 0.3
COLUMN_SHARE = 0.01
SWEEP = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)


def llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def vit() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        num_labels=32,
    )
    model = ViTForImageClassification(cfg)
    x = torch.randn(32, 3, 32, 32)  # 32 x 17 tokens: a multiple of 32
    return model, {"pixel_values": x, "labels": torch.randint(0, 32, (32,))}


class _Classifier(nn.Module):
    """A model that returns its loss, as the transformers models do: forecast backpropagates it."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.cross_entropy(self.body(x).float(), labels)}


def convnet() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    body = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 32),
    )
    x = torch.randn(32, 3, 8, 8)
    return _Classifier(body), {"x": x, "labels": torch.randint(0, 32, (32,))}


MODELS = {"llama": llama, "vit": vit, "convnet": convnet}


def plant(model: nn.Module, gen: torch.Generator, n: int) -> list[str]:
    """Plant ``n`` operand distributions; returns what was planted where."""
    linears = [(k, m) for k, m in model.named_modules() if isinstance(m, nn.Linear)]
    norms = [(k, m) for k, m in model.named_modules() if "norm" in type(m).__name__.lower() and hasattr(m, "weight")]
    done = []
    for _ in range(n):
        kind = int(torch.randint(0, 6 if norms else 4, (1,), generator=gen))
        big = float(10 ** (3 + 4 * torch.rand((), generator=gen)))
        with torch.no_grad():
            if kind < 4:
                name, m = linears[int(torch.randint(0, len(linears), (1,), generator=gen))]
                w = m.weight
                r = int(torch.randint(0, w.shape[0], (1,), generator=gen))
                c = int(torch.randint(0, w.shape[1], (1,), generator=gen))
                amax = float(w.abs().amax())
                if kind == 0:
                    w[r, c] = big * amax
                elif kind == 1:
                    w[r, :] *= big
                elif kind == 2:
                    w[:, c] *= big
                else:
                    w *= 10 ** (-6 * torch.rand(w.shape[1], generator=gen))
                done.append(f"{name}:{['elem', 'row', 'col', 'wide_cols'][kind]}")
            else:
                name, m = norms[int(torch.randint(0, len(norms), (1,), generator=gen))]
                w = m.weight
                if kind == 4:
                    w[int(torch.randint(0, w.shape[0], (1,), generator=gen))] *= big
                else:
                    w *= 10 ** (-6 * torch.rand(w.shape[0], generator=gen))
                done.append(f"{name}:{['outlier_channel', 'wide_channels'][kind - 4]}")
    return done


def capture(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each Linear's input and grad_output from one float32 forward and backward of the model's loss."""
    got: dict[str, dict[str, torch.Tensor]] = {}
    handles = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue

        def fwd(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor, name: str = name) -> None:
            got.setdefault(name, {})["input"] = args[0].detach().clone()
            if out.requires_grad:
                out.register_hook(lambda g: got[name].__setitem__("grad_output", g.detach().clone()))

        handles.append(m.register_forward_hook(fwd))
    try:
        out = model(**inputs)
        (out["loss"] if isinstance(out, dict) else out.loss).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return got


def _float8_layer(layer: nn.Linear, recipe: str, emulate: bool = True) -> nn.Module:
    from castwise.float8.convert import _float8_config, mx_training
    from castwise.policy.float8 import Float8Recipe

    layer = copy.deepcopy(layer)
    if recipe == "mxfp8":
        holder = nn.Sequential(layer)
        mx_training(holder, emulate, lambda *_: True)
        if layer.bias is None:
            return holder[0]
        # torchao 0.18's MX linear override drops F.linear's bias (forecast leaves such layers out
        # for that alone); the truth here judges the scaling's numbers, so the bias goes back on
        bias = layer.bias
        return _Biased(holder[0], bias)
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(layer, config=_float8_config(Float8Recipe.parse(recipe), emulate=emulate))


class _Biased(nn.Module):
    def __init__(self, inner: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x) + self.bias
        return out


def _column_bad(got: torch.Tensor, ref: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of columns of ``ref = a @ b`` that the float8 result ``got`` loses: error over
    the root-sum-square of the column's terms (a cancelling sum is not judged by its small result)."""
    a, b = a.reshape(-1, a.shape[-1]).double(), b.double()
    scale = (a.square() @ b.square()).sqrt().norm(dim=0)
    err = (got.reshape(-1, got.shape[-1]).double() - ref.reshape(-1, ref.shape[-1]).double()).norm(dim=0)
    live = scale > 0
    share = (err[live] / scale[live] > COLUMN_ERROR).double().mean()
    return float(share) if live.any() else 0.0


def real_kernels(recipe: str) -> bool:
    """Whether this machine runs ``recipe``'s real float8 kernels (else the truth is emulated)."""
    if not torch.cuda.is_available():
        return False
    need = (10, 0) if recipe == "mxfp8" else (8, 9)
    return torch.cuda.get_device_capability() >= need


def truth(layer: nn.Linear, x: torch.Tensor, g: torch.Tensor | None, recipe: str, device: str = "cpu") -> float:
    """The largest share of lost features: columns of output and grad_input, rows and columns of
    grad_weight (a token's row is one token's signal, summed over in the weight gradient).
    ``device="cuda"``: the float8 layer runs torchao's real kernels where the GPU has them."""
    emulate = device == "cpu" or not real_kernels(recipe)
    dev = "cpu" if emulate else device
    layer = copy.deepcopy(layer).to(dev)
    x = x.to(dev)
    g = None if g is None else g.to(dev)
    ref_layer = copy.deepcopy(layer)
    w = layer.weight.detach()
    xr = x.clone().requires_grad_()
    yr = ref_layer(xr)
    f8 = _float8_layer(layer, recipe, emulate=emulate)
    # real float8 training keeps the model in bf16 (and torch._scaled_mm's rowwise kernel gives bf16
    # out only): the real run's high precision is bf16
    low = not emulate
    if low:
        f8 = f8.to(torch.bfloat16)
    x8 = (x.to(torch.bfloat16) if low else x.clone()).requires_grad_()
    y8 = f8(x8)
    worst = _column_bad(y8.detach(), yr.detach(), x, w.t())
    if g is not None:
        yr.backward(g)
        y8.backward(g.to(y8.dtype))
        assert xr.grad is not None and x8.grad is not None and ref_layer.weight.grad is not None
        w8 = next(p for n, p in f8.named_parameters() if n.endswith("weight")).grad
        assert w8 is not None
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        dw8, dw = w8, ref_layer.weight.grad
        worst = max(
            worst,
            _column_bad(x8.grad, xr.grad, g, w),
            _column_bad(dw8, dw, g2.t(), x2),
            _column_bad(dw8.t(), dw.t(), x2.t(), g2),  # its rows: output features
        )
    return worst


@dataclasses.dataclass
class Case:
    model: str
    seed: int
    planted: list[str]
    bad: dict[str, set[str]]  # recipe -> layers bad in its float8 run
    shares: dict[str, dict[str, dict[str, float]]]  # recipe -> layer -> operand -> share of lines lost
    gemm_shares: dict[str, dict[str, dict[str, float]]]  # recipe -> layer -> GEMM -> share of features lost
    leave: dict[str, set[str]]  # recipe -> forecast's leave-out list
    layers: list[str]
    emulated_bad: dict[str, set[str]] | None = None  # with a real-kernel truth: the emulated one


def run_case(model_name: str, seed: int, plants: int, device: str = "cpu") -> Case:
    torch.manual_seed(seed)
    model, inputs = MODELS[model_name]()
    gen = torch.Generator().manual_seed(1000 + seed)
    planted = plant(model, gen, plants)
    ops = capture(model, inputs)
    layers = sorted(ops)
    bad: dict[str, set[str]] = {}
    shares: dict[str, dict[str, dict[str, float]]] = {}
    gemm_shares: dict[str, dict[str, dict[str, float]]] = {}
    leave: dict[str, set[str]] = {}
    emulated: dict[str, set[str]] | None = {} if device != "cpu" else None

    def judged(recipe: str, dev: str) -> set[str]:
        return {
            n
            for n in layers
            if truth(model.get_submodule(n), ops[n]["input"], ops[n].get("grad_output"), recipe, dev) > COLUMN_SHARE
        }

    for recipe, target in RECIPES.items():
        bad[recipe] = judged(recipe, device)
        if emulated is not None:
            emulated[recipe] = judged(recipe, "cpu")
        report = castwise.forecast(model, inputs, target=target)
        f8 = report.summary["float8"]
        leave[recipe] = set(f8["leave_out"])
        shares[recipe] = {n: f8["layers"][n]["lost_share"] for n in layers}
        gemm_shares[recipe] = {n: f8["layers"][n]["gemm_lost_share"] for n in layers}
    return Case(model_name, seed, planted, bad, shares, gemm_shares, leave, layers, emulated)


def score(
    cases: list[Case], recipe: str, threshold: float | None, parts: tuple[str, ...] = ("operand", "gemm")
) -> tuple[int, int, int, int]:
    """(true positives, false positives, false negatives, layers) of the leave-out list; ``parts``:
    its numeric reasons that count (an operand's lost lines, a GEMM's lost features)."""
    tp = fp = fn = n = 0
    for c in cases:
        for layer in c.layers:
            n += 1
            # the shapes are all valid here: the list's numeric part, at the threshold
            said = "operand" in parts and any(
                s > (threshold or f8l.THRESHOLD) for s in c.shares[recipe][layer].values()
            )
            said |= "gemm" in parts and any(s > f8l.GEMM_SHARE for s in c.gemm_shares[recipe][layer].values())
            real = layer in c.bad[recipe]
            tp += said and real
            fp += said and not real
            fn += real and not said
    return tp, fp, fn, n


def _fmt(tp: int, fp: int, fn: int, n: int) -> str:
    rec = tp / (tp + fn) if tp + fn else 1.0
    prec = tp / (tp + fp) if tp + fp else 1.0
    return f"recall {rec:.2f} ({tp}/{tp + fn})  precision {prec:.2f} ({tp}/{tp + fp})  layers {n}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="tuning seeds (the threshold sweep)")
    ap.add_argument("--held-out", default="3,4,5", help="held-out seeds (the shipped threshold only)")
    ap.add_argument("--plants", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--truth-device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--recipes", default=",".join(RECIPES), help="a subset of " + ", ".join(RECIPES))
    args = ap.parse_args()
    for name in [r for r in list(RECIPES) if r not in args.recipes.split(",")]:
        del RECIPES[name]  # torchao's MX training refuses torch releases older than its own
    if args.truth_device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--truth-device cuda: torch sees no CUDA device here")
        cap = torch.cuda.get_device_capability()
        real = [r for r in RECIPES if real_kernels(r)]
        print(f"truth on {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}: ")
        print(f"  real float8 kernels for {real or 'no recipe'}; emulated for the rest")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    models = args.models.split(",")
    groups = {
        "tune": [int(s) for s in args.seeds.split(",") if s],
        "held-out": [int(s) for s in args.held_out.split(",") if s],
    }
    for group, seeds in groups.items():
        cases = [run_case(m, s, args.plants, args.truth_device) for s in seeds for m in models]
        for c in cases:
            print(f"[{group}] {c.model} seed {c.seed} planted {c.planted}")
            for recipe in RECIPES:
                print(f"    {recipe:<10} bad {sorted(c.bad[recipe])}  leave {sorted(c.leave[recipe])}")
        print(f"== {group} seeds {seeds}, shipped threshold {f8l.THRESHOLD}")
        for recipe in RECIPES:
            print(f"  {recipe:<10} {_fmt(*score(cases, recipe, None))}")
            for part in ("operand", "gemm"):
                print(f"    {part + ' only':<12} {_fmt(*score(cases, recipe, None, (part,)))}")
        if args.truth_device != "cpu":
            for recipe in RECIPES:
                pairs = [(n in c.bad[recipe], n in (c.emulated_bad or {})[recipe]) for c in cases for n in c.layers]
                same = sum(a == b for a, b in pairs)
                real_bad, emu_bad = sum(a for a, _ in pairs), sum(b for _, b in pairs)
                print(
                    f"  truth {recipe:<10} emulated agrees with {'real' if real_kernels(recipe) else 'emulated'}"
                    f" on {same}/{len(pairs)} layers (bad: real {real_bad}, emulated {emu_bad})"
                )
        if group == "tune":
            print("  sweep of the operands' lost-line threshold (the GEMMs' part fixed):")
            for t in SWEEP:
                row = "  ".join(f"{r}: {_fmt(*score(cases, r, t))}" for r in RECIPES)
                print(f"  sweep {t:<5} {row}")


if __name__ == "__main__":
    main()
