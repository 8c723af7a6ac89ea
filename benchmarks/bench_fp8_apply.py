"""``castwise.apply(model, "fp8")`` on the zoo's LLMs: a few CPU training steps (torchao's float8
emulated) against the same steps under bf16-mixed, with the layers converted and left out.

    python benchmarks/bench_fp8_apply.py [--steps 4] [--policy fp8] [--models llama,mistral,...]

Each model is built twice from the same seed; both copies train ``--steps`` AdamW steps on the
same batches (causal-LM loss on random tokens), one under ``bf16-mixed``, one under the float8
policy. The measure is the largest relative loss difference over the steps; the bar is compare's
tolerance for the float8 format (``TOLERANCE_FACTOR`` x its unit roundoff: 0.25 for e4m3).
After the run ``remove()`` must leave the model's module classes and Parameter objects as they
were (checked, printed as ``restored``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zoo import models as zoo

import castwise
from castwise.numerics._compare_core import TOLERANCE_FACTOR
from castwise.numerics._compare_target import UNIT_ROUNDOFF
from castwise.policy.float8 import Float8Recipe

LLMS = ("llama", "mistral", "qwen2", "opt", "phi", "gpt2")


@dataclass(frozen=True)
class Row:
    model: str
    converted: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...]
    losses_ref: tuple[float, ...]
    losses_fp8: tuple[float, ...]
    restored: bool

    @property
    def max_rel(self) -> float:
        return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(self.losses_fp8, self.losses_ref, strict=True))


def tolerance(policy: str) -> float:
    recipe = castwise.Policy.parse(policy).float8 or Float8Recipe()
    return TOLERANCE_FACTOR * UNIT_ROUNDOFF[getattr(torch, recipe.forward_dtype)]


def _train(name: str, policy: str, steps: int, tokens: int, seed: int) -> tuple[list[float], castwise.Applied, bool]:
    model, _ = zoo.build(name, seed=seed)
    model.train()
    classes = [type(m) for m in model.modules()]
    params = list(model.parameters())
    applied = castwise.apply(model, policy)
    opt = torch.optim.AdamW(params, lr=1e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, tokens), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    applied.remove()
    restored = [type(m) for m in model.modules()] == classes and all(
        a is b for a, b in zip(model.parameters(), params, strict=True)
    )
    return losses, applied, restored


def measure(name: str, policy: str = "fp8", steps: int = 4, tokens: int = 16, seed: int = 0) -> Row:
    """bf16-mixed and ``policy`` trained from the same weights on the same batches."""
    ref, _, _ = _train(name, "bf16-mixed", steps, tokens, seed)
    low, applied, restored = _train(name, policy, steps, tokens, seed)
    plan = applied.float8
    assert plan is not None
    return Row(name, plan.converted, plan.left_out, tuple(ref), tuple(low), restored)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--policy", default="fp8")
    ap.add_argument("--tokens", type=int, default=16, help="sequence length (batch 2); mxfp8 needs 2*tokens % 32 == 0")
    ap.add_argument("--models", default=",".join(LLMS))
    ap.add_argument("--verbose", action="store_true", help="list every layer, converted or left out and why")
    args = ap.parse_args(argv)
    tol = tolerance(args.policy)
    print(f"policy {args.policy} vs bf16-mixed, {args.steps} AdamW steps, tolerance {tol:.3g} (relative loss)")
    print(f"{'model':<10} {'converted':>9} {'left out':>8} {'max rel':>9} {'within':>6} {'restored':>8}")
    failed = 0
    for name in args.models.split(","):
        row = measure(name, args.policy, args.steps, args.tokens)
        within = row.max_rel <= tol
        failed += not (within and row.restored)
        print(
            f"{name:<10} {len(row.converted):>9} {len(row.left_out):>8} {row.max_rel:>9.1e} "
            f"{'yes' if within else 'NO':>6} {'yes' if row.restored else 'NO':>8}"
        )
        reasons: dict[str, int] = {}
        for _n, why in row.left_out:
            reasons[why.split(":")[0].split(" (")[0]] = reasons.get(why.split(":")[0].split(" (")[0], 0) + 1
        print("           left out: " + ("; ".join(f"{k} x{v}" for k, v in reasons.items()) or "none"))
        if args.verbose:
            for n in row.converted:
                print(f"           {n}: float8")
            for n, why in row.left_out:
                print(f"           {n}: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
