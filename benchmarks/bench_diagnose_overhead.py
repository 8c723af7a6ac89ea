"""Overhead of castwise.diagnose() while nothing fails, in a small training loop.

Runs the same training steps bare and with every step wrapped in ``castwise.diagnose()`` (the
worst case: one enter/exit per step), interleaved with a second bare run that measures the
machine's noise floor, and prints the median ratio (target <= 1.02) next to the measured cost
of one enter/exit. On a shared machine the loop ratios wander by several percent either way
(see the noise floor); the enter/exit cost is the overhead itself.

usage: python benchmarks/bench_diagnose_overhead.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import castwise


def make_step() -> Callable[[], float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 256)

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def timed(loop: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> float:
    t0 = clock()
    loop()
    return clock() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps per timed block")
    parser.add_argument("--rounds", type=int, default=31, help="rounds of blocks (bare, diagnose, bare again)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread keeps timings steadier
    step = make_step()

    def bare() -> None:
        for _ in range(args.steps):
            step()

    def wrapped() -> None:
        for _ in range(args.steps):
            with castwise.diagnose():
                step()

    def bare_again() -> None:  # the same loop again: the noise floor of this machine
        for _ in range(args.steps):
            step()

    for _ in range(3):  # warm-up: allocator, autocast caches, lazy imports
        bare()
        wrapped()
    # interleaved blocks: each round runs bare, diagnose and bare again back to back (order
    # alternating), so load from other processes hits both sides alike; CPU time of this process
    # is less sensitive to that load than wall time
    wall: list[float] = []
    cpu: list[float] = []
    floor: list[float] = []
    plain_ms: list[float] = []
    for i in range(args.rounds):
        order = (bare, wrapped, bare_again) if i % 2 == 0 else (bare_again, wrapped, bare)
        t: dict[str, tuple[float, float]] = {}
        for loop in order:
            c0, w0 = time.process_time(), time.perf_counter()
            loop()
            t[loop.__name__] = (time.perf_counter() - w0, time.process_time() - c0)
        base_wall = (t["bare"][0] + t["bare_again"][0]) / 2
        base_cpu = (t["bare"][1] + t["bare_again"][1]) / 2
        wall.append(t["wrapped"][0] / base_wall)
        cpu.append(t["wrapped"][1] / base_cpu)
        floor.append(t["bare_again"][1] / t["bare"][1])
        plain_ms.append(base_wall / args.steps * 1e3)
    step_s = statistics.median(plain_ms) / 1e3
    print(f"{args.rounds} rounds of {args.steps} training steps; bare step {step_s * 1e3:.3f} ms (median)")
    # the cost itself: one enter/exit per step
    n = 200_000
    empty = timed(lambda: [None for _ in range(n)])
    cm = timed(lambda: [_enter_exit() for _ in range(n)])
    per_call = max(cm - empty, 0.0) / n
    print(f"enter/exit of diagnose(): {per_call * 1e6:.3f} us = {per_call / step_s * 100:.4f}% of a step")
    q = statistics.quantiles(floor, n=10)
    print(
        f"noise floor, bare vs the same bare loop: median {statistics.median(floor):.4f}, "
        f"10-90% {q[0]:.3f}..{q[-1]:.3f}"
    )
    print(f"wall-time ratio (median of rounds): {statistics.median(wall):.4f}")
    print(f"diagnose overhead ratio (CPU time, median of rounds): {statistics.median(cpu):.4f} (target <= 1.02)")


def _enter_exit() -> None:
    with castwise.diagnose():
        pass


if __name__ == "__main__":
    main()
