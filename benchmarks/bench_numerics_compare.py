"""castwise.compare on real models: planted sensitive modules ranked first, healthy models quiet,
and the cost against the two plain runs.

    python benchmarks/bench_numerics_compare.py [--seed 0] [--cases 12] [--models bert,gpt2,...]

For each model (transformers BERT, GPT-2, Llama, T5, ViT; timm ConvNeXt and ViT; torchvision
ResNet-18 and MobileNetV3; a torch.nn encoder; all from configs, no weights):
- healthy: compare under bf16-mixed, count modules past tolerance (target: 0);
- planted: ``--cases`` times, a seeded random Linear/Conv is wrapped in a precision-sensitive
  module (catastrophic cancellation, one-pass variance norm; under 16-true also a tiny-epsilon
  norm and a large-magnitude projection), under bf16-mixed or 16-true by turns; a hit is the
  planted module ranked first by added error (target: >= 90%);
- cost: compare's wall time over the two plain runs it replaces (the reference and the policy,
  forward and backward), interleaved, median of 3, on batches of 8 x 64 tokens or 8 images of
  64x64 (target: <= 3x).
``--inline``: only ``inline-rmsnorm-tiny-eps`` under 16-true, the norm written in the forward of
a module with children (an attention, an MLP, a block), so the module's own ops are the fault.
``--seed`` changes the planted modules, kinds and inputs (a held-out set is another seed).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _numerics_models import MODELS, build, choose, inline_parents, plant, plant_inline

import castwise
from castwise.numerics._compare_run import call_model, loss_of, projection

POLICIES = ("bf16-mixed", "16-true")


def _plain(model: torch.nn.Module, inputs: Any, policy: str) -> float:
    twin = copy.deepcopy(model)
    castwise.apply(twin, policy)
    twin.train()
    start = time.perf_counter()
    out = call_model(twin, inputs)
    loss_of(out, projection(out)).backward()
    return time.perf_counter() - start


def cost(model: torch.nn.Module, inputs: Any, policy: str) -> tuple[float, float]:
    plain, full = [], []
    for _ in range(3):
        plain.append(_plain(model, inputs, "32-true") + _plain(model, inputs, policy))
        start = time.perf_counter()
        castwise.compare(model, inputs, policy=policy)
        full.append(time.perf_counter() - start)
    return statistics.median(full), statistics.median(plain)


def planted_cases(name: str, seed: int, cases: int, inline: bool = False) -> list[dict[str, Any]]:
    rng = random.Random(f"{name}-{seed}{'-inline' if inline else ''}")
    out = []
    for i in range(cases):
        model, inputs = build(name, seed * 1000 + i)
        policy = "16-true" if inline else POLICIES[i % 2]
        if inline:  # the fault in a module's own forward, among its children
            where, kind = rng.choice(inline_parents(model, inputs)), "inline-rmsnorm-tiny-eps"
            plant_inline(model, where)
        else:
            where, cls = choose(model, policy, rng)
            kind = cls.kind
            plant(model, where, cls)
        report = castwise.compare(model, inputs, policy=policy)
        ranked = report.summary["ranked"]
        out.append(
            {
                "model": name,
                "policy": policy,
                "kind": kind,
                "planted": where,
                "first": ranked[0] if ranked else None,
                "hit": bool(ranked) and ranked[0] == where,
                "first_past_tolerance": report.summary["first_past_tolerance"],
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-cost", action="store_true")
    parser.add_argument(
        "--inline", action="store_true", help="only inline-rmsnorm-tiny-eps: a norm in a module's own forward"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # steadier timings on a shared machine
    all_cases: list[dict[str, Any]] = []
    ratios: list[float] = []
    print(f"{'model':<14} {'healthy past tol':>16} {'hits':>9} {'cost x':>8}  misses")
    for name in args.models.split(","):
        model, inputs = build(name, args.seed)
        healthy = castwise.compare(model, inputs, policy="bf16-mixed")
        rows = healthy.to_dict()["numerics"]
        past = [row["module"] for row in rows if row["past_tolerance"]]
        alone = [row["module"] for row in rows if row["added_err"] is None]
        ratio = float("nan")
        if not args.no_cost:
            full, plain = cost(*build(name, args.seed, big=True), "bf16-mixed")
            ratio = full / plain
        cases = planted_cases(name, args.seed, args.cases, args.inline)
        all_cases += cases
        hits = sum(c["hit"] for c in cases)
        misses = "; ".join(f"{c['kind']}@{c['planted']} ({c['policy']}) -> {c['first']}" for c in cases if not c["hit"])
        notes = (f" PAST: {past}" if past else "") + (f" NOT ALONE: {alone}" if alone else "")
        print(f"{name:<14} {len(past):>16} {hits:>4}/{len(cases):<4} {ratio:>8.2f}  {misses}{notes}", flush=True)
        ratios.append(ratio)
    total = sum(c["hit"] for c in all_cases)
    print(
        f"\nplanted module ranked first: {total}/{len(all_cases)} = {100 * total / max(len(all_cases), 1):.1f}% "
        f"across {len(args.models.split(','))} models (seed {args.seed})"
    )
    if not args.no_cost:
        print(
            f"compare / two plain runs: median {statistics.median(ratios):.2f}x, max {max(ratios):.2f}x, "
            f"<= 3x on {sum(r <= 3 for r in ratios)}/{len(ratios)} models"
        )
    by_kind: dict[str, list[bool]] = {}
    for c in all_cases:
        by_kind.setdefault(f"{c['kind']} ({c['policy']})", []).append(c["hit"])
    for kind, hits in sorted(by_kind.items()):
        print(f"  {kind:<48} {sum(hits)}/{len(hits)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
