"""Real-tensor tracing overhead: a small model run bare vs. under castwise's tracer.

    python benchmarks/bench_trace_overhead.py

Runs forward + backward (train) and forward under no_grad (eval) of two small models on real CPU
tensors, bare and under ``castwise.trace.tracer`` (dispatch mode + global module hooks +
provenance + contract checks, as ``castwise.audit(..., fake=False)`` does), and prints the time
ratio per model. The tiny MLP shows the per-op cost; the transformer shows a realistic mix.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from castwise.trace.tracer import Tracer, run


def tiny_mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32)), (torch.randn(16, 32),)


def transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), (torch.randn(8, 128, 256),)


def bare(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    model.train()
    model(*inputs).float().sum().backward()
    model.eval()
    with torch.no_grad():
        model(*inputs)


def traced(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    for mode in ("train", "eval"):
        tracer = Tracer(model, "cpu", fake=False, inputs=[(f"arg{i}", t) for i, t in enumerate(inputs)])
        trace = run(tracer, model, inputs, {}, mode, engine_backward=True)
        assert trace.error is None, trace.error


def timed(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the machine is shared: one thread keeps the timings comparable
    for name, build, repeat in (("tiny MLP", tiny_mlp, 20), ("transformer 4x256", transformer, 3)):
        model, inputs = build()
        base = timed(lambda: bare(model, inputs), repeat)  # noqa: B023
        with_tracer = timed(lambda: traced(model, inputs), repeat)  # noqa: B023
        print(
            f"{name:<18} bare {base * 1e3:8.1f} ms   traced {with_tracer * 1e3:8.1f} ms   "
            f"overhead ratio {with_tracer / base:.2f}x"
        )


if __name__ == "__main__":
    main()
