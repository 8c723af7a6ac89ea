"""forecast(target="f16") from a float32 run against what a real float16 run shows, and its cost.

Cases, across the real models of numerics_zoo (seeded):

- forward: one Linear/Conv of a random module scaled so its output passes 65504 by a random
  margin in [2^0.2, 2^3];
- backward: a random module's gradient amplified past 65504 in backward only;
- clean: the model as built.

Ground truth: the fp16 overflow sites (module, phase) of the real float16 run (model.half(), same
inputs), one definition shared with forecast (docs/numerics.md): an op that makes +-Inf in a
float16 output from finite inputs holding no float16 limit value (mask fills), where the same op
on the same inputs in float32 stays finite. Forecast's sites: its CW310 findings.
Forward cases compare forward sites (after a forward overflow, a float16 backward is all NaN and
shows nothing); backward and clean cases compare both phases. Recall = true sites forecast
found; precision = forecast sites that are true. Cost: forecast's wall time over a plain float32
forward + backward of the same model (interleaved, medians).

    python benchmarks/bench_numerics_forecast.py [--per-model 6] [--seed 0] [--held-out]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).parent))
from bench_numerics_locate import ScaleGrad, candidates
from numerics_zoo import MODELS, call, half_inputs, loss_of

from castwise.numerics import _run
from castwise.numerics.forecast import forecast
from castwise.numerics.observe import _UNINITIALISED, _widen
from castwise.trace.observers import Observer, OpCall

F16_MAX = float(torch.finfo(torch.float16).max)


class OverflowSites(Observer):
    """The fp16 overflow sites of a real float16 run, (module, phase): ops that make +-Inf in a
    float16 output from inputs that are finite and hold no float16 limit value (a finfo.min/max
    mask fill stands for -inf: saturating it is the mask working, not an overflow), where the same
    op on the same inputs in float32 is finite (float16's range made the Inf, not the computation:
    T5's log of a zero relative position is -inf in float32 too)."""

    name = "overflow_sites"

    def __init__(self) -> None:
        self.sites: set[tuple[str, str]] = set()
        self._pre: tuple[OpCall, dict[int, torch.Tensor]] | None = None

    def check(self, call: OpCall) -> None:
        # an in-place op overwrites its inputs: keep them as they were (a benchmark can afford it)
        if call.func._schema.is_mutable:
            self._pre = (call, {id(t): t.detach().clone() for t in call.tensors})
        return None

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        pre, self._pre = self._pre, None
        if call.func.is_view or call.name in _UNINITIALISED:
            return
        outs = [o for o in outputs if o.dtype == torch.float16 and o.numel()]
        if not outs or not any(bool(torch.isinf(o).any()) for o in outs):
            return
        if any(isinstance(x, float) and not math.isfinite(x) for x in (*call.args, *call.kwargs.values())):
            return
        saved = pre[1] if pre is not None and pre[0] is call else {}
        args, kwargs = tree_map(
            lambda x: saved.get(id(x), x) if isinstance(x, torch.Tensor) else x, (call.args, call.kwargs)
        )
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not all(bool(torch.isfinite(t).all()) for t in ins if t.numel()):
            return
        if any(t.dtype == torch.float16 and bool((t.abs() == F16_MAX).any()) for t in ins if t.numel()):
            return
        try:
            w_args, w_kwargs = tree_map(_widen, (args, kwargs))
            wide = call.func(*w_args, **w_kwargs)
        except Exception:  # no float32 kernel for it: counted, as the Inf is there
            self.sites.add((call.module, call.phase))
            return
        flat = [w for w in tree_flatten(wide)[0] if isinstance(w, torch.Tensor) and w.is_floating_point()]
        if all(bool(torch.isfinite(w).all()) for w in flat):
            self.sites.add((call.module, call.phase))


def plant(model: nn.Module, kind: str, cands: dict[str, tuple[float, float]], rng: random.Random) -> str | None:
    names = sorted(cands)
    if kind == "forward":
        layers = [n for n in names if isinstance(model.get_submodule(n), (nn.Linear, nn.Conv2d, nn.Conv1d))]
        if not layers:
            return None
        name = rng.choice(layers)
        layer = model.get_submodule(name)
        factor = 65504.0 * 2.0 ** rng.uniform(0.2, 3.0) / cands[name][0]
        weight: Any = layer.weight
        if float(weight.detach().abs().max()) * factor > 30000:
            return None
        with torch.no_grad():
            weight.mul_(factor)
            if getattr(layer, "bias", None) is not None:
                layer.bias.mul_(factor)  # type: ignore[operator]
        return name
    if kind == "backward":
        name = rng.choice(names)
        module = model.get_submodule(name)
        inner = module.forward
        factor = 65504.0 * 2.0 ** rng.uniform(1.0, 4.0) / cands[name][1]
        module.forward = lambda *a, **k: ScaleGrad.apply(inner(*a, **k), factor)  # type: ignore[method-assign]
        return name
    return ""


def truth(model: nn.Module, inputs: Any) -> set[tuple[str, str]]:
    sites = OverflowSites()
    half = model.half()
    with _run.kept_as_is(half):
        _run.traced(half, _run.Capture(half), _run.real_inputs(half_inputs(inputs), "cpu"), "train", "cpu", [sites])
    return sites.sites


def cost(model: nn.Module, inputs: Any, repeats: int = 3) -> float:
    plain, fc = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        loss_of(call(model, inputs)).backward()
        plain.append(time.perf_counter() - start)
        model.zero_grad()
        start = time.perf_counter()
        forecast(model, inputs, target="f16")
        fc.append(time.perf_counter() - start)
    return statistics.median(fc) / statistics.median(plain)


def one_case(model_name: str, kind: str, rng: random.Random) -> dict[str, Any] | None:
    torch.manual_seed(rng.randrange(1 << 30))
    model, inputs = MODELS[model_name]()
    cands = candidates(model, inputs)
    if not cands:
        return None
    planted = plant(model, kind, cands, rng)
    if planted is None:
        return None
    report = forecast(model, inputs, target="f16")
    predicted = {(f.module or "", dict(f.details)["phase"]) for f in report.findings if f.code == "CW310"}
    real = truth(model, inputs)
    if kind == "forward":
        predicted = {s for s in predicted if s[1] == "forward"}
        real = {s for s in real if s[1] == "forward"}
    return {"model": model_name, "kind": kind, "planted": planted, "predicted": predicted, "real": real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-model", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="score an unseen set (seeds 10_000 + seed)")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    seed = args.seed + (10_000 if args.held_out else 0)
    kinds = ("forward", "backward", "clean")
    rows = []
    ratios = {}
    for m_index, model_name in enumerate(args.models.split(",")):
        rng = random.Random(seed * 1000 + m_index)
        for i in range(args.per_model):
            row = one_case(model_name, kinds[i % 3], rng)
            if row is not None:
                rows.append(row)
                if row["predicted"] != row["real"]:
                    print("DIFF", row, flush=True)
        torch.manual_seed(seed)
        model, inputs = MODELS[model_name]()
        ratios[model_name] = cost(model, inputs)
    tp = sum(len(r["predicted"] & r["real"]) for r in rows)
    n_real = sum(len(r["real"]) for r in rows)
    n_pred = sum(len(r["predicted"]) for r in rows)
    print(
        f"\nforecast(f16) vs a real float16 run: {len(rows)} cases across {len(ratios)} models (seed {seed}"
        f"{', held-out' if args.held_out else ''}), {n_real} real overflow sites"
    )
    for kind in kinds:
        sub = [r for r in rows if r["kind"] == kind]
        k_tp = sum(len(r["predicted"] & r["real"]) for r in sub)
        print(
            f"  {kind:9s} {len(sub):3d} cases  real sites {sum(len(r['real']) for r in sub):3d}  "
            f"forecast {sum(len(r['predicted']) for r in sub):3d}  both {k_tp:3d}"
        )
    print(f"recall:    {tp}/{n_real} = {tp / max(n_real, 1):.1%} (target >= 95%)")
    print(f"precision: {tp}/{n_pred} = {tp / max(n_pred, 1):.1%} (target >= 90%)")
    for name, ratio in ratios.items():
        print(f"  cost {name:26s} forecast / plain f32 step = {ratio:.2f}x")
    print(f"forecast cost, median over models: {statistics.median(ratios.values()):.2f}x a plain run (target <= 1.5x)")


if __name__ == "__main__":
    main()
