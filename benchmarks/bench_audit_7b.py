"""Audit a 7B-parameter Llama built on the meta device: time against a bare fake run, and memory.

    python benchmarks/bench_audit_7b.py [--seq 16] [--layers 32] [--rounds 3] [--size 7b|405b]

Builds ``LlamaForCausalLM`` with transformers' LlamaConfig defaults (hidden 4096, 32 layers,
intermediate 11008, vocab 32000: ~6.7B parameters) on the meta device (``--size 405b``: the
Llama-3.1-405B config instead: hidden 16384, 126 layers, 128 heads / 8 KV heads, intermediate
53248, vocab 128256, llama3 rope scaling), then times
``castwise.audit(model, ids, policy="bf16-mixed", device="cuda", mode="both")`` against the bare
work it wraps, in the same process: a fake-tensor copy of the model on CUDA under bf16 CUDA
autocast, run forward + backward (train) and forward under no_grad (eval), without tracing.
(Bare backward uses castwise's node walker too: the autograd engine cannot run fake CUDA tensors
on a machine without a GPU.) Prints the ratio and the peak RSS. Targets: the 7B audit <= 1.0x
its bare run; with ``--size 405b`` the bare run timed is the 7B's (built too), and the 405B audit
targets <= 2.0x that bare 7B run. Repeated blocks are traced once (``castwise.trace.reuse``);
``CASTWISE_BLOCK_REUSE=0`` measures the audit without it.

The machine may be shared: the two are measured in pairs (bare, then audit), one pair per
round after a warm-up pair, and the ratio printed is the median of the pairs' ratios, with each
pair's ratio, the best-of ratio, the same in CPU time of this thread (which other jobs on the
machine disturb less than wall time) and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import castwise
from castwise import _autocast
from castwise.trace import fake as fake_mod
from castwise.trace.backward import python_backward
from castwise.trace.tracer import Tracer


def llama_405b(layers: int | None = None) -> Any:
    """The Llama-3.1-405B config (published sizes), optionally with fewer layers."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126 if layers is None else layers,
        num_attention_heads=128,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def build(layers: int | None, size: str = "7b") -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = llama_405b(layers) if size == "405b" else LlamaConfig(num_hidden_layers=layers or 32)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model


def bare(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Fake forward+backward (train) and forward (eval) on CUDA under bf16 autocast, untraced."""
    start = time.perf_counter()
    for mode in ("train", "eval"):
        fmode = fake_mod.new_mode()
        copy = fake_mod.fake_model(model, fmode, "cuda")
        fids = fake_mod.fake_input(ids, fmode, "cuda", {})
        with fmode:
            if mode == "train":
                copy.train()
                with _autocast.autocast("cuda", torch.bfloat16):
                    out = copy(input_ids=fids)
                loss = out.logits.float().sum()
                walker = Tracer(torch.nn.Module(), "cuda", fake=True, record_ops=False)
                python_backward(walker.at, [loss], [None])
            else:
                copy.eval()
                with torch.no_grad(), _autocast.autocast("cuda", torch.bfloat16):
                    copy(input_ids=fids)
    return time.perf_counter() - start


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, this thread's CPU seconds, result) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    out = fn()
    return time.perf_counter() - wall, time.thread_time() - cpu, out


def step_pairs(plain: Callable[[], Any], stepped: Callable[[], Any], rounds: int) -> None:
    """The audit with the optimizer step against the audit without, back to back in pairs."""
    timed(stepped)  # warm-up: the optimizer's first import and build
    ratios = []
    for i in range(rounds):
        p_wall, p_cpu, _ = timed(plain)
        s_wall, s_cpu, report = timed(stepped)
        ratios.append((s_wall / p_wall, s_cpu / p_cpu))
        print(
            f"step pair {i + 1}: audit {p_wall:.2f}s, audit+step {s_wall:.2f}s: {s_wall / p_wall:.2f}x "
            f"(CPU {s_cpu / p_cpu:.2f}x)"
        )
    ledger = report.to_dict().get("ledger", {})
    print(
        f"audit with the optimizer step: {statistics.median(r for r, _ in ratios):.2f}x the audit (median of "
        f"{rounds}, target <= 1.3x); CPU-time {statistics.median(c for _, c in ratios):.2f}x; ledger rows "
        f"{len(ledger.get('rows', []))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="default: the config's (32; 405b: 126)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", choices=("7b", "405b"), default="7b")
    parser.add_argument(
        "--step",
        action="store_true",
        help="also time the audit with an AdamW step (optimizer=, the precision ledger) against the audit "
        "without it, in pairs (target <= 1.3x)",
    )
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    model = build(opts.layers, opts.size)
    n_params = sum(p.numel() for p in model.parameters())
    layers = model.config.num_hidden_layers
    print(
        f"built LlamaForCausalLM ({opts.size} config) on meta: {n_params / 1e9:.2f}B parameters, {layers} layers "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    ids = torch.randint(0, model.config.vocab_size, (1, opts.seq))
    # the bare run is the 7B's: the 405B audit is held to a multiple of it
    ref = build(None, "7b") if opts.size == "405b" else model
    ref_ids = torch.randint(0, ref.config.vocab_size, (1, opts.seq))
    target = 2.0 if opts.size == "405b" else 1.0

    def audit() -> castwise.Report:
        return castwise.audit(model, ids, policy="bf16-mixed", device="cuda", mode="both")

    load_before = os.getloadavg()
    # the first audit is timed on its own (the 405B question: one audit, cold), then a warm-up
    # bare run, then the pairs
    first, first_cpu, report = timed(audit)
    print(f"first castwise.audit (cold): {first:.2f}s wall, {first_cpu:.2f}s CPU")
    bare(ref, ref_ids)
    pairs: list[tuple[float, float, float, float]] = []
    for i in range(opts.rounds):
        b_wall, b_cpu, _ = timed(lambda: bare(ref, ref_ids))
        a_wall, a_cpu, report = timed(audit)
        pairs.append((b_wall, a_wall, b_cpu, a_cpu))
        print(
            f"pair {i + 1}: bare {b_wall:.2f}s, audit {a_wall:.2f}s: ratio {a_wall / b_wall:.2f}x "
            f"(CPU {b_cpu:.2f}s / {a_cpu:.2f}s: {a_cpu / b_cpu:.2f}x)"
        )
    load_after = os.getloadavg()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB
    if pairs:
        ratio = statistics.median(a / b for b, a, _bc, _ac in pairs)
        cpu_ratio = statistics.median(a / b for _b, _a, b, a in pairs)
        best = min(p[1] for p in pairs) / min(p[0] for p in pairs)
        print(f"bare fake train+eval (7b): {statistics.median(p[0] for p in pairs):.2f}s (median of {len(pairs)})")
        print(f"castwise.audit:       {statistics.median(p[1] for p in pairs):.2f}s (median of {len(pairs)})")
        print(
            f"ratio: {ratio:.2f}x median of {len(pairs)} interleaved pairs (target <= {target}x); best-of {best:.2f}x; "
            f"CPU-time ratio {cpu_ratio:.2f}x"
        )
    if opts.step:
        step_pairs(
            audit,
            lambda: castwise.audit(
                model,
                ids,
                policy="bf16-mixed",
                device="cuda",
                mode="both",
                optimizer=torch.optim.AdamW,
                optimizer_kwargs={"lr": 1e-5},
            ),
            max(1, opts.rounds),
        )
    print(f"load average: {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs)")
    print(f"peak RSS:             {rss:.2f} GiB (target < 2 GiB)")
    print(f"findings: {[(f.code, f.module) for f in report.findings]}")
    print(f"ops traced: {report.summary.get('ops_traced')}")


if __name__ == "__main__":
    main()
