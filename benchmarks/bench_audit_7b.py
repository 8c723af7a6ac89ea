"""Audit a 7B-parameter Llama built on the meta device: time against a bare fake run, and memory.

    python benchmarks/bench_audit_7b.py [--seq 16] [--layers 32]

Builds ``LlamaForCausalLM`` with transformers' LlamaConfig defaults (hidden 4096, 32 layers,
intermediate 11008, vocab 32000: ~6.7B parameters) on the meta device, then times
``castwise.audit(model, ids, policy="bf16-mixed", device="cuda", mode="both")`` against the bare
work it wraps, in the same process: a fake-tensor copy of the model on CUDA under bf16 CUDA
autocast, run forward + backward (train) and forward under no_grad (eval), without tracing.
(Bare backward uses castwise's node walker too: the autograd engine cannot run fake CUDA tensors
on a machine without a GPU.) Prints the ratio and the peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time
import warnings

import torch

import castwise
from castwise import _autocast
from castwise.trace import fake as fake_mod
from castwise.trace.backward import python_backward
from castwise.trace.tracer import Tracer


def build(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model


def bare(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Fake forward+backward (train) and forward (eval) on CUDA under bf16 autocast, untraced."""
    start = time.perf_counter()
    for mode in ("train", "eval"):
        fmode = fake_mod.new_mode()
        copy = fake_mod.fake_model(model, fmode, "cuda")
        fids = fake_mod.fake_inputs(ids, fmode, "cuda", {})
        with fmode:
            if mode == "train":
                copy.train()
                with _autocast.autocast("cuda", torch.bfloat16):
                    out = copy(input_ids=fids)
                loss = out.logits.float().sum()
                walker = Tracer(torch.nn.Module(), "cuda", fake=True, record_ops=False)
                python_backward(walker, [loss], [None])
            else:
                copy.eval()
                with torch.no_grad(), _autocast.autocast("cuda", torch.bfloat16):
                    copy(input_ids=fids)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    model = build(opts.layers)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"built LlamaForCausalLM on meta: {n_params / 1e9:.2f}B parameters, {opts.layers} layers "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    ids = torch.randint(0, 32000, (1, opts.seq))

    def audit() -> tuple[float, castwise.Report]:
        start = time.perf_counter()
        report = castwise.audit(model, ids, policy="bf16-mixed", device="cuda", mode="both")
        return time.perf_counter() - start, report

    # warm-up (first calls fill caches in torch and transformers), then alternate the two so
    # load from other jobs on the machine hits both alike; best of each
    bare(model, ids)
    audit()
    bases, tooks = [], []
    for _ in range(opts.rounds):
        bases.append(bare(model, ids))
        took, report = audit()
        tooks.append(took)
    base, took = min(bases), min(tooks)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB
    print(f"bare fake train+eval: {base:.2f}s")
    print(f"castwise.audit:       {took:.2f}s  (ratio {took / base:.2f}x, target <= 2x; best of {opts.rounds})")
    print(f"peak RSS:             {rss:.2f} GiB (target < 2 GiB)")
    print(f"findings: {[(f.code, f.module) for f in report.findings]}")
    print(f"ops traced: {report.summary.get('ops_traced')}")


if __name__ == "__main__":
    main()
