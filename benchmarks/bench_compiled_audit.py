"""Cost of auditing a torch.compile'd model: ``castwise.audit(torch.compile(model))`` against
``castwise.audit(model)`` of the same zoo model, and the floor no compiled audit can go below:
the eager audit plus Dynamo alone tracing the model (``backend="eager"``: no AOTAutograd, no
checks), since a compiled audit must run Dynamo to see what the compiled program is.

    python benchmarks/bench_compiled_audit.py [--models deberta_v2,tv_mobilenet_v2] [--policy bf16-mixed]
        [--mode train] [--repeats 3] [--out results.json]

One process, one torch thread. Each model is built from its config (no download), seeded, and
every timed call gets a fresh build. Every path runs once untimed first (imports, Dynamo's
per-process set-up: a cost of the process, not of an audit), then the paths run interleaved
``--repeats`` times and each figure is the median. A compiled audit compiles anew each time (its
cache entries are dropped after it); the Dynamo-alone run resets Dynamo after each call. Columns:
the eager audit, the compiled audit of an Inductor program (graphs traced with Inductor's
decompositions) and of an ``aot_eager`` one, and the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from benchmarks.zoo import models  # noqa: E402
from benchmarks.zoo.cases import quiet  # noqa: E402

import castwise  # noqa: E402
from castwise.trace.observers import pick_loss  # noqa: E402

DEFAULT = "deberta_v2,tv_mobilenet_v2,peft_lora_llama"


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _call(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*(inputs if isinstance(inputs, tuple) else (inputs,)))


def _paths(name: str, policy: str | None, mode: str) -> dict[str, Any]:
    def eager() -> None:
        model, inputs = models.build(name, 0)
        castwise.audit(model, inputs, policy=policy, mode=mode)

    def compiled(backend: str) -> Any:
        def run() -> None:
            model, inputs = models.build(name, 0)
            castwise.audit(torch.compile(model, backend=backend), inputs, policy=policy, mode=mode)

        return run

    def dynamo_alone() -> None:
        """Dynamo tracing the model once per audited mode, the graph run as it is (real tensors)."""
        for m in ("train", "eval") if mode == "both" else (mode,):
            model, inputs = models.build(name, 0)
            model.train(m == "train")
            try:
                with torch.set_grad_enabled(m == "train"):
                    loss = pick_loss(_call(torch.compile(model, backend="eager"), inputs))
                    if loss is not None and m == "train":
                        loss.backward()  # type: ignore[no-untyped-call]
            finally:
                torch._dynamo.reset()

    return {
        "eager_s": eager,
        "compiled_s": compiled("inductor"),
        "aot_eager_s": compiled("aot_eager"),
        "dynamo_alone_s": dynamo_alone,
    }


def measure(name: str, policy: str | None, mode: str, repeats: int) -> dict[str, Any]:
    paths = _paths(name, policy, mode)
    for fn in paths.values():
        fn()  # untimed: the process's own first-call costs
    times: dict[str, list[float]] = {key: [] for key in paths}
    for _ in range(repeats):
        for key, fn in paths.items():
            times[key].append(_seconds(fn))
    med = {key: statistics.median(v) for key, v in times.items()}
    return {
        "model": name,
        **{key: round(v, 3) for key, v in med.items()},
        "ratio": round(med["compiled_s"] / med["eager_s"], 1),
        "aot_eager_ratio": round(med["aot_eager_s"] / med["eager_s"], 1),
        "floor_ratio": round((med["eager_s"] + med["dynamo_alone_s"]) / med["eager_s"], 1),
        "load": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default=DEFAULT, help=f"comma-separated zoo models (default {DEFAULT})")
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--mode", default="both", choices=("both", "train", "eval"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    names = [n.strip() for n in opts.models.split(",") if n.strip()]
    rows = [measure(name, opts.policy or None, opts.mode, opts.repeats) for name in names]
    head = ("model", "eager s", "compiled s", "ratio", "aot_eager s", "ratio", "dynamo s", "floor", "load")
    print("{:24} {:>8} {:>10} {:>6} {:>11} {:>6} {:>8} {:>6} {:>5}".format(*head))
    for r in rows:
        print(
            f"{r['model']:24} {r['eager_s']:8} {r['compiled_s']:10} {r['ratio']:6} {r['aot_eager_s']:11} "
            f"{r['aot_eager_ratio']:6} {r['dynamo_alone_s']:8} {r['floor_ratio']:6} {r['load']:5}"
        )
    if opts.out is not None:
        opts.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
