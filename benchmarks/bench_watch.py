"""castwise.watch on a ~100M-parameter model: per-step overhead, a NaN planted at a random step,
and what the replay (locate_nonfinite) and forecast cost against a plain training step.

The model: GPT-2 built from a config (no download), 10 layers, d=768 (about 100M parameters),
trained with AdamW on random tokens. Plain and watched steps are interleaved in one process and
compared by their medians. Then a fault (0/0 in a random module's forward, data-dependent: only
for the batch of a random step) is planted and the loop runs under watch until it stops.

    python benchmarks/bench_watch.py [--steps 6] [--seq 128] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
from torch import nn

from castwise.numerics.forecast import forecast
from castwise.numerics.locate import locate_nonfinite
from castwise.numerics.watch import NonfiniteError, watch


def build(seq: int) -> tuple[nn.Module, int]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=10, n_embd=768, n_head=12, n_positions=max(seq, 128), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(cfg)
    return model, sum(p.numel() for p in model.parameters())


def step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


class Fault:
    """0/0 in one module's forward, for the batch whose first token is ``trigger`` only."""

    def __init__(self, module: nn.Module, trigger: int) -> None:
        self.trigger = trigger
        self.ids: torch.Tensor | None = None
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if self.ids is not None and int(self.ids[0, 0]) == self.trigger and isinstance(out, torch.Tensor):
                zero = out - out
                return out + zero / zero
            return out

        module.forward = forward  # type: ignore[method-assign]


def overhead(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step(model, opt, batches[0])  # warm-up
    plain, watched = [], []
    with watch(model) as w:
        for b in batches:
            watched.append(step(model, opt, b))
            w.__exit__(None, None, None)  # disarmed: a plain step on the same model
            plain.append(step(model, opt, b))
            w.__enter__()
    return statistics.median(plain), statistics.median(watched)


def own_work(model: nn.Module, batch: dict[str, torch.Tensor], repeats: int = 200) -> float:
    """Seconds watch adds to one step, timed by itself: the forward wrapper's record (input
    references, random and autocast state) and the loss check. Robust to a busy machine, where
    two whole-step medians differ by more than this."""
    loss = torch.tensor(2.5)
    with watch(model) as w:
        start = time.perf_counter()
        for _ in range(repeats):
            w.record((), batch)
            w.check(loss)
        return (time.perf_counter() - start) / repeats


def planted_run(model: nn.Module, seq: int, rng: random.Random) -> tuple[str, str | None, int, int, float]:
    leaves = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "mlp.act", "ln_1", "ln_2")
    names = [n for n, _ in model.named_modules() if n.startswith("transformer.h.") and n.endswith(leaves)]
    target = rng.choice(sorted(names))
    fault_step = rng.randrange(2, 6)
    fault = Fault(model.get_submodule(target), trigger=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    found: str | None = None
    stopped = -1
    replay = 0.0
    with watch(model) as w:
        for i in range(8):
            ids = torch.randint(8, 1000, (2, seq), generator=gen)
            if i == fault_step:
                ids[0, 0] = 7  # this batch triggers the fault
            fault.ids = ids
            try:
                start = time.perf_counter()
                step(model, opt, {"input_ids": ids, "labels": ids})
            except NonfiniteError as exc:
                replay = time.perf_counter() - start
                found = exc.report.findings[0].module if exc.report.findings else None
                stopped = i
                break
    del w
    return target, found, fault_step, stopped, replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model, n_params = build(args.seq)
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(0, 50257, (2, args.seq))
        batches.append({"input_ids": ids, "labels": ids})
    plain, watched = overhead(model, batches)
    print(f"GPT-2 {n_params / 1e6:.0f}M parameters, batch 2 x {args.seq}, {args.steps} interleaved steps each")
    print(f"plain step {plain:.3f} s, watched step {watched:.3f} s: watch = {watched / plain:.3f}x (target <= 1.01x)")
    own = own_work(model, batches[0])
    print(f"watch's own work per step {own * 1e6:.1f} us = {1 + own / plain:.5f}x a plain step")

    batch = batches[0]
    start = time.perf_counter()
    locate_nonfinite(model, batch)
    locate_s = time.perf_counter() - start
    start = time.perf_counter()
    forecast(model, batch, target="f16")
    forecast_s = time.perf_counter() - start
    print(f"locate_nonfinite (the replay) {locate_s:.3f} s = {locate_s / plain:.2f}x a plain step (target <= 3x)")
    print(f"forecast(f16) {forecast_s:.3f} s = {forecast_s / plain:.2f}x a plain step (target <= 1.5x)")

    target, found, fault_step, stopped, replay = planted_run(model, args.seq, random.Random(args.seed))
    print(
        f"NaN planted in `{target}` at step {fault_step}: watch stopped at step {stopped}, named `{found}` "
        f"({'right' if found == target and stopped == fault_step else 'WRONG'}); that step with its replay took "
        f"{replay:.3f} s = {replay / plain:.2f}x a plain step"
    )


if __name__ == "__main__":
    main()
