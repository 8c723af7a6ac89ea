"""Does ``compare(torch.compile(model), x, policy=..., reference="eager")`` name the module where
the compiled (Inductor, CPU) and the eager numerics diverge?

    python benchmarks/bench_compiled_compare.py [--set tuning|held-out|both] [--seeds 4,5] [--limit N] [--json PATH]
    python benchmarks/bench_compiled_compare.py --clean   # false alarms on the unplanted models

Each case: a real model built from its config (no weights), seeded, with one Linear/Conv wrapped
by a planted module whose eager and Inductor numerics really differ:

- ``fused-cancel`` (bf16-true): ``(h * 256 + h) - h * 256``: eager rounds ``h * 256 + h`` to bf16
  and loses most of ``h``; Inductor fuses the chain into one kernel that keeps float32;
- ``chain-sum`` (bf16-true): a row mean accumulated as a chain of adds of offset values: eager
  rounds the running sum after every add, the fused kernel accumulates in float32;
- ``f16-overflow`` (16-true): an RMS norm of ``h`` scaled past float16's range before squaring:
  eager's f16 square overflows (the norm returns 0), Inductor's fused f32 kernel does not.

Truth is the planted module, CHECKED first: the whole planted model (the policy's copy) run
eagerly and through ``torch.compile`` (Inductor) must differ past the tolerance compare uses
(4 unit roundoffs of the policy's format), else the case is dropped and counted. Seeds 0-1 are
the tuning set, seeds 2-5 the held-out set (``--seeds`` runs others). Prints cases, first-named
correct, the share, and in how many emulate_precision_casts=True closes the gap at the named
module.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from benchmarks._numerics_models import Plant, plant, plantable  # noqa: E402
from torch import nn  # noqa: E402

import castwise  # noqa: E402

SETS = {"tuning": (0, 1), "held-out": (2, 3, 4, 5)}
TOLERANCE = {"bf16-true": 4 * 2.0**-8, "16-true": 4 * 2.0**-11}


class FusedCancel(Plant):
    kind = "fused-cancel"

    def op(self, h: torch.Tensor) -> torch.Tensor:
        big = h * 256.0
        return (big + h) - big


class ChainSum(Plant):
    kind = "chain-sum"

    def op(self, h: torch.Tensor) -> torch.Tensor:
        n = min(h.shape[-1], 32)
        offset = 64.0 * h.detach().abs().amax()
        acc = h[..., 0] + offset
        for i in range(1, n):
            acc = acc + (h[..., i] + offset)
        return h - (acc - n * offset).unsqueeze(-1) / n


class F16Overflow(Plant):
    kind = "f16-overflow"

    def op(self, h: torch.Tensor) -> torch.Tensor:
        s = 1024.0 / h.detach().abs().amax().clamp(min=1e-6)
        hs = h * s
        return h * torch.rsqrt((hs * hs).mean(-1, keepdim=True) + 1e-6) * s


PLANTS: dict[str, tuple[type[Plant], ...]] = {"bf16-true": (FusedCancel, ChainSum), "16-true": (F16Overflow,)}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(seed))


def gpt2(seed: int) -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2Model(cfg), {"input_ids": _ids(seed)}


def llama(seed: int) -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return LlamaModel(cfg), {"input_ids": _ids(seed)}


def bert(seed: int) -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    return BertModel(cfg, add_pooling_layer=False), {"input_ids": _ids(seed)}


def tv_resnet(seed: int) -> tuple[nn.Module, Any]:
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    model.layer3 = nn.Identity()  # a smaller graph: compiles take seconds each on a loaded CPU
    model.layer4 = nn.Identity()
    model.fc = nn.Linear(128, 10)
    return model, (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed)),)


def mlp(seed: int) -> tuple[nn.Module, Any]:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
    return model, (torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)),)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "tv-resnet18": tv_resnet, "nn-mlp": mlp}


def _case(name: str, seed: int) -> tuple[nn.Module, Any, str, str, str]:
    rng = random.Random(f"{name}-{seed}")
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = MODELS[name](seed)
    model.eval()
    # the three plants equally likely (each with the policy it diverges under)
    policy, cls = rng.choice([(p, c) for p in sorted(PLANTS) for c in PLANTS[p]])
    where = rng.choice([n for n in plantable(model) if "lm_head" not in n])
    plant(model, where, cls)
    return model, inputs, policy, where, cls.kind


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _real(model: nn.Module, inputs: Any, policy: str) -> bool:
    """The divergence is real: the whole planted model under the policy, eager vs Inductor."""
    import copy

    from castwise.numerics._compare_compiled import divergence

    twin = copy.deepcopy(model)
    castwise.apply(twin, policy)
    with torch.no_grad():
        eager = _call(twin, inputs)
        compiled = _call(torch.compile(twin, isolate_recompiles=True), inputs)
    return divergence(compiled, eager) > TOLERANCE[policy]


def run(seeds: tuple[int, ...], limit: int | None) -> dict[str, Any]:
    cases = [(name, seed) for seed in seeds for name in MODELS][:limit]
    out: dict[str, Any] = {"cases": 0, "correct": 0, "dropped": 0, "closes": 0, "rows": []}
    for name, seed in cases:
        model, inputs, policy, where, kind = _case(name, seed)
        start = time.perf_counter()
        if not _real(model, inputs, policy):
            out["dropped"] += 1
            print(f"  {name:12} seed {seed} {kind:13} at {where}: no real divergence, dropped", flush=True)
            continue
        report = castwise.compare(torch.compile(model), inputs, policy=policy, reference="eager", mode="eval")
        s = report.summary
        ok = s["first_divergent"] == where
        out["cases"] += 1
        out["correct"] += ok
        out["closes"] += bool(s["emulate_precision_casts_closes"])
        row = {"model": name, "seed": seed, "plant": kind, "truth": where, "named": s["first_divergent"]}
        row |= {"ok": ok, "closes": s["emulate_precision_casts_closes"], "compiles": s["compiles"]}
        out["rows"].append(row | {"seconds": round(time.perf_counter() - start, 1)})
        print(
            f"  {name:12} seed {seed} {kind:13} truth {where:28} named {s['first_divergent']!s:28} "
            f"{'ok' if ok else 'MISS'} closes={s['emulate_precision_casts_closes']} compiles={s['compiles']}",
            flush=True,
        )
    return out


def clean() -> dict[str, Any]:
    """False alarms: every model unplanted (seed 0) under both policies should name nothing."""
    out: dict[str, Any] = {"runs": 0, "named_nothing": 0, "rows": []}
    for name in MODELS:
        for policy in sorted(PLANTS):
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, inputs = MODELS[name](0)
            model.eval()
            s = castwise.compare(torch.compile(model), inputs, policy=policy, reference="eager", mode="eval").summary
            out["runs"] += 1
            out["named_nothing"] += s["first_divergent"] is None
            out["rows"].append({"model": name, "policy": policy, "named": s["first_divergent"], "err": s["output_err"]})
            print(f"  clean {name:12} {policy:9} named {s['first_divergent']!s:20} whole {s['output_err']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("tuning", "held-out", "both"), default="both")
    parser.add_argument("--limit", type=int, default=None, help="cases per set")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds instead of a set's")
    parser.add_argument("--json", default=None)
    parser.add_argument("--clean", action="store_true", help="only the unplanted models (false alarms)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    if args.clean:
        r = clean()
        print(f"clean: {r['named_nothing']} of {r['runs']} runs named nothing", flush=True)
        results["clean"] = r
        args.set, args.seeds = "none", None
    sets = dict(SETS)
    if args.seeds:
        sets = {"seeds": tuple(int(s) for s in args.seeds.split(","))}
    chosen = () if args.set == "none" else sets if args.set == "both" or args.seeds else (args.set,)
    for which in chosen:
        print(f"{which} set (seeds {sets[which]}):", flush=True)
        r = run(sets[which], args.limit)
        share = 100.0 * r["correct"] / max(r["cases"], 1)
        print(
            f"{which}: {r['cases']} cases ({r['dropped']} dropped: no real divergence), first-named correct "
            f"{r['correct']} ({share:.0f}%), emulate_precision_casts closes the gap in {r['closes']}",
            flush=True,
        )
        results[which] = r
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
