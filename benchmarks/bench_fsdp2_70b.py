"""A 70B Llama, sharded by ``castwise.fsdp2.fully_shard`` over 64 simulated ranks, audited on fake tensors.

    python benchmarks/bench_fsdp2_70b.py [--world 64] [--layers 80] [--seq 16] [--policy bf16-true] [--mode train]

Builds ``LlamaForCausalLM`` from Llama-3-70B's shape (hidden 8192, 80 layers, intermediate 28672,
64 heads, 8 KV heads, vocab 128256: ~70.6B parameters) on the meta device, starts torch.distributed's
fake process group (rank 0 of ``--world``: collectives do nothing, no other process exists), shards
the model with castwise's per-unit plan (DTensor parameters, FSDP2 hooks), then times
``castwise.audit(model, ids, device="cuda", mode=...)`` on it: the per-unit records from the FSDP2
states and the fake-tensor forward and backward of what the units compute. Prints the audit's wall
and CPU time and the peak RSS of the process (the acceptance: audit <= 30 s, RSS < 2 GiB).
"""

from __future__ import annotations

import argparse
import resource
import time
import warnings

import torch


def build(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        model: torch.nn.Module = LlamaForCausalLM(config)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--policy", default="bf16-true")
    parser.add_argument("--mode", default="train", choices=["train", "eval", "both"])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import castwise
    import castwise.fsdp2

    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=opts.world)
    model = build(opts.layers)
    n = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    castwise.fsdp2.fully_shard(model, opts.policy)
    t2 = time.perf_counter()
    print(
        f"built Llama-70B shape on meta: {n / 1e9:.1f}B parameters, {opts.layers} layers in {t1 - t0:.1f}s; "
        f"fully_shard over {opts.world} fake ranks in {t2 - t1:.1f}s"
    )
    ids = torch.randint(0, 128256, (1, opts.seq))
    start, cpu = time.perf_counter(), time.process_time()
    report = castwise.audit(model, ids, device=opts.device, mode=opts.mode)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    units = report.to_dict()["units"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    print(report.title)
    print(
        f"runs: {', '.join(f'{r.mode}: {r.status}' for r in report.runs)}; findings: {len(report.findings)}; "
        f"units: {len(units)}; bytes per rank (stored): {sum(u['bytes_per_rank'] for u in units) / 2**30:.2f} GiB"
    )
    for u in units[:2] + units[-2:]:
        print(
            f"  {u['unit']}: {u['kind']}, stored {u['stored']}, gather {u['gather']}, compute {u['compute']}, "
            f"reduce {u['reduce']}, output {u['output']}"
        )
    # the CPU time is what the audit costs; wall time also counts other jobs on a shared machine
    print(
        f"audit wall time: {wall:.1f} s, CPU time {cpu:.1f} s (acceptance <= 30 s); "
        f"peak RSS: {rss:.2f} GiB (acceptance < 2 GiB)"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
