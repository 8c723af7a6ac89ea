"""castwise run: the cost of its wrapper on a training step after the first (target <= 1.05x).

`castwise run` wraps ``nn.Module.__call__`` for the whole script; after a model's first forward
(audited once) every module call still passes through the wrapper. This measures a GPT-2-style
training step (transformers, small config, CPU, bf16 autocast) with and without the watcher,
interleaved in one process, after a warm-up step each.

    python benchmarks/bench_run_overhead.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=2048)
    return GPT2LMHeadModel(config), torch.randint(0, 2048, (8, 128))


def _step(model: torch.nn.Module, ids: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    from castwise.integrations.run import Watcher

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    ns = parser.parse_args()
    model, ids = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = Watcher()
    _step(model, ids, opt)  # warm-up, unwatched
    with watcher.watching():
        first = _step(model, ids, opt)  # the audited first forward
    bare: list[float] = []
    watched: list[float] = []
    for _ in range(ns.rounds):
        bare.append(_step(model, ids, opt))
        with watcher.watching():
            watched.append(_step(model, ids, opt))
    b, w = statistics.median(bare), statistics.median(watched)
    print(f"first step (audited): {first:.2f} s; audits run: {len(watcher.reports)}")
    print(f"step after the first: bare {b * 1000:.1f} ms, under castwise run {w * 1000:.1f} ms: {w / b:.3f}x")


if __name__ == "__main__":
    main()
