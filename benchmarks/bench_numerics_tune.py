"""castwise.tune on real models: the budget met by a verified run, with few float32 FLOPs and
few runs.

    python benchmarks/bench_numerics_tune.py [--seed 0] [--budget 1e-2]

Models: the T5-style encoder whose `wo` breaks float16 (castwise.stories.build_t5_overflow,
16-true with transformers' hard-coded float32 `wo` turned off), and six-layer BERT, GPT-2,
Llama, T5, ViT, timm ViT, a torch.nn encoder, timm ConvNeXt-atto and torchvision's ResNet-18
and MobileNetV3, each with one seeded
precision-sensitive module planted on a Linear/Conv holding <= 4% of the forward FLOPs
(cancellation or a one-pass variance under bf16-mixed; a tiny-epsilon norm or a large-magnitude
projection under 16-true). The budget is --budget, or twice the healthy model's loss error
under the policy when that is larger (a tighter budget is below what the format gives, plant
or no plant). The metric is the model's own loss where it returns one, its output (relative L2)
otherwise. Per model: the metric's error without islands, the islands tune returns, the error
of the verified run under them, the share of forward FLOPs in those islands (target <= 5%; a
policy's own islands, T5's `wo` under 16-true, are not tune's), and the number of real runs
(target <= 2 + log2(modules)).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from _numerics_models import PLANTS, build, plant, plantable

import castwise
from castwise.numerics.tune import _forward_flops

MODELS = (
    "bert",
    "gpt2",
    "llama",
    "t5",
    "vit",
    "timm-vit",
    "timm-convnext",
    "nn-encoder",
    "tv-resnet18",
    "tv-mobilenet",
)


def _planted(name: str, seed: int) -> tuple[nn.Module, Any, str, str, str, float]:
    """The planted model, its inputs, policy, planted module and kind, and the healthy model's
    loss error under the policy (a budget below it is below what the format gives)."""
    rng = random.Random(f"tune-{name}-{seed}")
    layers = {} if name.startswith("tv-") else {"layers": 6}
    model, inputs = build(name, seed, **layers)
    flops = _forward_flops(model, inputs)
    total = flops.get("", 0)
    small = [n for n in plantable(model) if 0 < flops.get(n, 0) <= 0.04 * total]
    where = rng.choice(small)
    policy = rng.choice(tuple(PLANTS))
    cls = rng.choice(PLANTS[policy][:2] if policy == "bf16-mixed" else PLANTS[policy][2:])
    summary = castwise.compare(model, inputs, policy=policy).summary
    # what tune measures: the model's own loss, or its outputs when it returns none
    healthy = summary["loss_err"] if summary["metric"] == "loss" else summary["output_err"]
    plant(model, where, cls)
    return model, inputs, policy, where, cls.kind, healthy


def _row(label: str, model: nn.Module, inputs: Any, policy: str, budget: float, planted: str) -> bool:
    n_modules = len(list(model.modules()))
    start = time.perf_counter()
    tuned = castwise.tune(model, inputs, policy=policy, budget=budget)
    wall = time.perf_counter() - start
    f32_share = tuned.island_share  # the islands tune added (a policy's own, T5's wo under 16-true, excluded)
    bound = 2 + math.log2(n_modules)
    ok = tuned.met and f32_share <= 0.05 and tuned.runs <= bound
    found = planted in tuned.islands if planted else True
    print(
        f"{label:<44} {policy:<26} {tuned.metric:<6} {budget:>8.1e} {tuned.baseline_error:>9.2e} {tuned.error:>9.2e} "
        f"{100 * f32_share:>6.2f}% "
        f"{tuned.runs:>3}/{bound:<5.1f} {wall:>6.1f}s  {'ok' if ok else 'FAIL'}"
        f"{'' if found else ' (planted module not in islands)'}  islands: {', '.join(tuned.islands) or '-'}",
        flush=True,
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=1e-2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(
        f"{'model (planted)':<44} {'policy':<26} {'metric':<6} {'budget':>8} {'no island':>9} {'tuned':>9} "
        f"{'f32 FLOPs':>7} {'runs':>9} {'time':>7}"
    )
    from castwise.stories import build_t5_overflow

    model, inputs = build_t5_overflow()
    results = [
        _row(
            "t5-overflow (wo weights past 65504)",
            model,
            inputs,
            "16-true,keep_in_fp32=off",
            args.budget,
            "encoder.block.2.layer.1.DenseReluDense.wo",
        )
    ]
    for name in MODELS:
        model, inputs, policy, where, kind, healthy = _planted(name, args.seed)
        budget = max(args.budget, 2 * healthy)
        results.append(_row(f"{name} ({kind})", model, inputs, policy, budget, where))
    print(
        f"\nbudget met with <= 5% float32 FLOPs within 2 + log2(modules) runs: {sum(results)}/{len(results)} "
        f"models (T5-style: {'yes' if results[0] else 'no'}; others: {sum(results[1:])}/{len(results) - 1})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
