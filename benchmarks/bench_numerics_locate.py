"""locate_nonfinite on NaN/Inf planted at random modules of real models, forward and backward.

Each fault is planted in one module (its forward wrapped, so the planted op runs in that
module), of one of four kinds:

- fwd_precision (float16 model): the module's weights (Linear/Conv) or its output scaled so its
  output passes 65504 by ~2^2; float32 computes it finite;
- fwd_bug: log(0), 0/0, inf - inf of a mask, softmax over an all -inf row (float16 or float32);
- bwd_precision (float16 model): the module's gradient amplified past 65504 in backward;
- bwd_bug: sqrt at 0 whose gradient is 0/0 in backward.

A fault is located when the first finding names the planted module; its verdict is right when
CW301 (precision) / CW302 (bug) matches the kind. Seeded: ``--seed`` picks the modules and
kinds; ``--held-out`` scores an unseen set (another seed range) the same way.

    python benchmarks/bench_numerics_locate.py [--per-model 20] [--seed 0] [--held-out]
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from numerics_zoo import MODELS, call, half_inputs, loss_of

from castwise.numerics.locate import locate_nonfinite

KINDS = ("fwd_precision", "fwd_bug", "bwd_precision", "bwd_bug")


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()  # not a view: the model may modify it in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def candidates(model: nn.Module, inputs: Any) -> dict[str, tuple[float, float]]:
    """Modules called once whose floating tensor output reaches the loss: name -> (output
    absmax, its gradient's absmax), from a clean float32 run."""
    calls: dict[str, int] = {}
    outs: dict[str, torch.Tensor] = {}
    names = {id(m): n for n, m in model.named_modules() if n}

    def hook(mod: nn.Module, args: Any, out: Any) -> None:
        name = names.get(id(mod))
        if name is None:
            return
        calls[name] = calls.get(name, 0) + 1
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.requires_grad and out.numel():
            out.retain_grad()
            outs[name] = out

    from torch.nn.modules import module as module_mod

    handle = module_mod.register_module_forward_hook(hook)
    try:
        model.train()
        loss_of(call(model, inputs)).backward()
    finally:
        handle.remove()
    model.zero_grad()
    found = {}
    for name, out in outs.items():
        # a gradient of rounding noise only (the sum of a normalised output) carries no fault
        if calls[name] == 1 and out.grad is not None and float(out.grad.abs().max()) > 1e-5:
            found[name] = (float(out.detach().abs().max()), float(out.grad.abs().max()))
    return found


def _bug(out: torch.Tensor, variant: int) -> torch.Tensor:
    zero = out - out
    if variant == 0:
        return out + torch.log(zero)  # log(0)
    if variant == 1:
        return out + zero / zero  # 0/0
    if variant == 2:
        masked = zero.masked_fill(torch.ones_like(out, dtype=torch.bool), float("-inf"))
        return out + (masked - masked)  # inf - inf of a mask
    row = zero.reshape(-1).masked_fill(torch.ones(zero.numel(), dtype=torch.bool), float("-inf"))
    return out + torch.softmax(row, 0).reshape(out.shape)  # softmax over an all -inf row


def plant(model: nn.Module, name: str, kind: str, stats: tuple[float, float], rng: random.Random) -> None:
    module = model.get_submodule(name)
    inner = module.forward
    amax, gmax = stats
    weight = getattr(module, "weight", None)
    if kind == "fwd_precision" and isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) and weight is not None:
        factor = 2.0**18 / max(amax, 1e-6)
        if float(weight.detach().abs().max()) * factor < 30000:
            with torch.no_grad():
                weight.mul_(factor)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    bias.mul_(factor)
            return
    variant = rng.randrange(4)

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if kind == "fwd_precision":
            return out * (2.0**18 / max(amax, 1e-6))
        if kind == "fwd_bug":
            return _bug(out, variant)
        if kind == "bwd_precision":
            return ScaleGrad.apply(out, 2.0**20 / max(gmax, 1e-30))
        return out + 0 * torch.sqrt(out - out)  # gradient of sqrt at 0: 0/0 in backward

    module.forward = forward  # type: ignore[method-assign]


def one_fault(
    base: nn.Module, inputs: Any, cands: dict[str, tuple[float, float]], model_name: str, kind: str, rng: random.Random
) -> dict[str, Any]:
    target = rng.choice(sorted(cands))
    model = copy.deepcopy(base)
    half = kind.endswith("precision") or rng.random() < 0.5
    if half:
        model, inputs = model.half(), half_inputs(inputs)
    plant(model, target, kind, cands[target], rng)
    torch.manual_seed(rng.randrange(1 << 30))
    start = time.perf_counter()
    report = locate_nonfinite(model, inputs)
    seconds = time.perf_counter() - start
    first = next((f for f in report.findings if f.code in ("CW301", "CW302")), None)
    want = "CW301" if kind.endswith("precision") else "CW302"
    return {
        "model": model_name,
        "kind": kind,
        "module": target,
        "dtype": "f16" if half else "f32",
        "found": None if first is None else first.module,
        "code": None if first is None else first.code,
        "located": first is not None and first.module == target,
        "verdict": first is not None and first.code == want,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-model", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="score an unseen set (seeds 10_000 + seed)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    seed = args.seed + (10_000 if args.held_out else 0)
    rows = []
    for m_index, model_name in enumerate(args.models.split(",")):
        rng = random.Random(seed * 1000 + m_index)
        torch.manual_seed(rng.randrange(1 << 30))
        base, inputs = MODELS[model_name]()
        cands = candidates(base, inputs)  # a fresh copy of this model per fault
        for i in range(args.per_model):
            row = one_fault(base, inputs, cands, model_name, KINDS[i % len(KINDS)], rng)
            rows.append(row)
            if args.verbose or not row["located"] or not row["verdict"]:
                print(("ok  " if row["located"] and row["verdict"] else "MISS"), row, flush=True)
    n = len(rows)
    located = sum(r["located"] for r in rows)
    verdicts = sum(r["verdict"] for r in rows)
    print(
        f"\nlocate_nonfinite on {n} planted faults across {len(set(r['model'] for r in rows))} models "
        f"(seed {seed}{', held-out' if args.held_out else ''}):"
    )
    for kind in KINDS:
        sub = [r for r in rows if r["kind"] == kind]
        print(
            f"  {kind:14s} {len(sub):4d} faults  located {sum(r['located'] for r in sub) / max(len(sub), 1):.1%}"
            f"  verdict {sum(r['verdict'] for r in sub) / max(len(sub), 1):.1%}"
        )
    for model_name in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model_name]
        print(
            f"  {model_name:26s} located {sum(r['located'] for r in sub)}/{len(sub)}"
            f"  verdict {sum(r['verdict'] for r in sub)}/{len(sub)}"
        )
    print(f"producing module named: {located}/{n} = {located / max(n, 1):.1%} (target >= 95%)")
    print(f"right verdict:          {verdicts}/{n} = {verdicts / max(n, 1):.1%} (target >= 95%)")
    print(f"median locate time: {sorted(r['seconds'] for r in rows)[n // 2]:.2f} s")


if __name__ == "__main__":
    main()
