"""Cost of auditing a torch.compile'd model: ``castwise.audit(torch.compile(model))`` against
``castwise.audit(model)`` of the same zoo model, and, as the floor no compiled audit can go
below, what Dynamo + AOTAutograd alone take to compile and run the same model (``aot_eager``,
forward + backward, no checks).

    python benchmarks/bench_compiled_audit.py [--models deberta_v2,tv_mobilenet_v2] [--policy bf16-mixed]
        [--mode train] [--out results.json]

Each model is built from its config (no download), seeded; every audit gets a fresh build. The
eager time is the faster of two runs (the first pays imports); a compiled audit compiles anew
each time (its cache entries are dropped after it), so one run is its cost.
"""

from __future__ import annotations

import argparse
import json
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
from castwise.trace.tracer import pick_loss  # noqa: E402

DEFAULT = "deberta_v2,tv_mobilenet_v2,peft_lora_llama,nn_gru"


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _bare_compile(name: str) -> float:
    """Dynamo + AOTAutograd alone (``aot_eager``, forward and backward, real CPU tensors of a
    model built small): the floor under any audit that compiles the model."""
    model, inputs = models.build(name, 0)
    compiled = torch.compile(model, backend="aot_eager")

    def run() -> None:
        if isinstance(inputs, dict):
            out = compiled(**inputs)
        else:
            out = compiled(*(inputs if isinstance(inputs, tuple) else (inputs,)))
        loss = pick_loss(out)
        if loss is not None:
            loss.backward()  # type: ignore[no-untyped-call]

    try:
        return _seconds(run)
    finally:
        torch._dynamo.reset()


def measure(name: str, policy: str | None, mode: str) -> dict[str, Any]:
    def eager() -> None:
        model, inputs = models.build(name, 0)
        castwise.audit(model, inputs, policy=policy, mode=mode)

    def compiled() -> None:
        model, inputs = models.build(name, 0)
        report = castwise.audit(torch.compile(model), inputs, policy=policy, mode=mode)
        graphs.append(sum(int(c["graphs"]) for c in report.summary["compiled"].values()))

    graphs: list[int] = []
    eager_s = min(_seconds(eager), _seconds(eager))
    compiled_s = _seconds(compiled)
    record = {
        "model": name,
        "eager_s": round(eager_s, 2),
        "compiled_s": round(compiled_s, 2),
        "ratio": round(compiled_s / eager_s, 1),
        "graphs": graphs[0],
    }
    try:
        record["bare_compile_s"] = round(_bare_compile(name), 2)
    except Exception as exc:  # the floor is a reference only; a model it cannot run still has its ratio
        record["bare_compile_s"] = f"{type(exc).__name__}"
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default=DEFAULT, help=f"comma-separated zoo models (default {DEFAULT})")
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--mode", default="both", choices=("both", "train", "eval"))
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args(argv)
    quiet()
    rows = [measure(name.strip(), opts.policy or None, opts.mode) for name in opts.models.split(",") if name.strip()]
    print(f"{'model':24} {'eager s':>8} {'compiled s':>10} {'ratio':>6} {'graphs':>6} {'bare compile s':>14}")
    for r in rows:
        print(
            f"{r['model']:24} {r['eager_s']:8} {r['compiled_s']:10} {r['ratio']:6} {r['graphs']:6} "
            f"{r['bare_compile_s']!s:>14}"
        )
    if opts.out is not None:
        opts.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
