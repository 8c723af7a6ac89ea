"""Two-release diff vs one audit (issue 36: a diff costs <= 1.5x one audit).

    python benchmarks/bench_torch_diff.py [--rounds 3] [--releases 2.11,2.15]

A small Llama (transformers, built from a config: RMSNorm, attention, MLP) audited on simulated
CUDA under bf16-mixed: ``castwise.audit`` as a user runs it (both modes), against
``castwise audit --torch A,B``'s work (``release_changes``: one forward under each release's
autocast). Both sides interleaved in one process, after one warm-up each; prints each median and
the ratio, and the modules the diff lists.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import castwise
from castwise import _releases as releases
from castwise.auditor.entry import release_changes
from castwise.run import check


def model() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4
    )
    return LlamaForCausalLM(config), {"input_ids": torch.randint(0, 512, (1, 64))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--releases", default=f"{releases.recorded()[0]},{releases.recorded()[-1]}")
    ns = parser.parse_args()
    before, after = (releases.parse_release(r) for r in ns.releases.split(","))
    net, inputs = model()
    request = check("audit", net, inputs, policy="bf16-mixed", device="cuda")

    def one_audit() -> object:
        return castwise.audit(net, inputs, policy="bf16-mixed", device="cuda")

    def diff() -> object:
        return release_changes(request, before, after)

    times: dict[str, list[float]] = {"audit": [], "diff": []}
    for i in range(ns.rounds + 1):
        for name, fn in (("audit", one_audit), ("diff", diff)):
            start = time.perf_counter()
            out = fn()
            if i:  # round 0 warms both up
                times[name].append(time.perf_counter() - start)
    a, d = statistics.median(times["audit"]), statistics.median(times["diff"])
    assert isinstance(out, dict)
    print(f"one audit: {a:.2f} s; diff torch {before} vs {after}: {d:.2f} s; ratio {d / a:.2f} (target <= 1.5)")
    names = ", ".join(m["module"] for m in out["modules"][:6])
    print(f"modules whose dtype flow changes: {len(out['modules'])} ({names})")


if __name__ == "__main__":
    main()
