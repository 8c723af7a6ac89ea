"""Worker processes for the 2-rank gloo FSDP2 tests (imported by torch.multiprocessing's spawn).

Each scenario builds the same tiny Llama on every rank, shards it with
``castwise.fsdp2.fully_shard`` and trains a few SGD steps on a fixed batch split by rank,
recording what ran: the weights' dtypes seen by islands and linear layers during forward, the
dtypes FSDP2's reduce-scatters ran in, the loss (averaged over ranks) and the step times.
Rank 0 writes everything to a JSON file the test reads.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

SEQ, VOCAB = 16, 128


def tiny_llama(layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model: torch.nn.Module = LlamaForCausalLM(config)
    return model


def batch(rows: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def _dtype(t: torch.Tensor) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(t.dtype, str(t.dtype))


def _record(seen: dict[str, set[str]], kind: str) -> Any:
    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        seen[f"{kind}_weight"].add(_dtype(module.weight))  # type: ignore[arg-type]
        seen[f"{kind}_out"].add(_dtype(out))

    return hook


def run_scenario(policy: str, steps: int, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import castwise
    import castwise.fsdp2

    model = tiny_llama()
    ids = batch(world)[rank : rank + 1]
    castwise.fsdp2.fully_shard(model, policy)
    seen: dict[str, set[str]] = {
        "island_weight": set(),
        "linear_weight": set(),
        "linear_out": set(),
        "island_out": set(),
        "logits": set(),
    }
    plan = castwise.fsdp2.plan_of(model)
    assert plan is not None
    islands = {u.name for u in plan.units if u.kind == "island"}
    for name, module in model.named_modules():
        if name in islands:
            # registered after FSDP2's pre-forward hook, so the weight is already gathered
            module.register_forward_pre_hook(lambda m, a: seen["island_weight"].add(_dtype(m.weight)))
            module.register_forward_hook(lambda m, a, o: seen["island_out"].add(_dtype(o)))
        elif isinstance(module, torch.nn.Linear):
            module.register_forward_hook(_record(seen, "linear"))
    reduce_dtypes: list[str] = []
    original = dist.reduce_scatter_single

    def spy(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduce_dtypes.append(_dtype(input))
        return original(output, input, *args, **kwargs)

    dist.reduce_scatter_single = spy  # FSDP2 looks it up on torch.distributed at each call
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, times = [], []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=ids, labels=ids)
            seen["logits"].add(_dtype(out.logits))
            out.loss.backward()
            optim.step()
            optim.zero_grad()
            times.append(time.perf_counter() - start)
            loss = out.loss.detach().float().clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
    finally:
        dist.reduce_scatter_single = original
    grads_dtype = sorted({_dtype(p.to_local()) for p in model.parameters()})  # type: ignore[operator]
    audit: dict[str, Any] = {}
    if rank == 0:  # the distributed audit on a really sharded model (gloo, real DTensors), after training
        report = castwise.audit(model, ids, mode="train")
        audit = {"ok": report.ok, "units": report.to_dict()["units"], "title": report.title}
    return {
        "policy": policy,
        "losses": losses,
        "times": times,
        "reduce_dtypes": sorted(set(reduce_dtypes)),
        "seen": {k: sorted(v) for k, v in seen.items()},
        "param_dtypes": grads_dtype,
        "plan": plan.to_dict(),
        "audit": audit,
    }


def worker(rank: int, world: int, port: int, out_path: str, scenarios: list[tuple[str, int]]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share a 2-core machine
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = [run_scenario(policy, steps, rank, world) for policy, steps in scenarios]
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def reference(policy: str, steps: int, world: int = 2) -> dict[str, Any]:
    """The same training on one process, unsharded, under ``castwise.apply`` of the same policy."""
    import castwise

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (this is the test process: restored below)
    try:
        model = tiny_llama()
        ids = batch(world)
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        losses, times = [], []
        with castwise.apply(model, policy):
            for _ in range(steps):
                start = time.perf_counter()
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()
                optim.step()
                optim.zero_grad()
                times.append(time.perf_counter() - start)
                losses.append(out.loss.item())
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "times": times}
