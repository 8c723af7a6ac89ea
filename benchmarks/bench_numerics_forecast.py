"""forecast(target="f16") from a float32 run against what a real float16 run shows, and its cost.

Cases, across the real models of numerics_zoo (seeded):

- forward: one Linear/Conv of a random module scaled so its output passes 65504 by a random
  margin in [2^0.2, 2^3];
- backward: a random module's gradient amplified past 65504 in backward only;
- clean: the model as built;
- multi / param: two or three forward faults one after another; a weight past the range and one;
- reduction: a Linear/Conv's output scaled within float16's range (2^8.5 to 2^14.5) into one norm
  or reduction, hand-written or torch's, with or without the model's own upcast or ``dtype=``
  (REDUCTIONS): whether float16 makes Inf there depends on how each op computes.

Models: numerics_zoo.MODELS; ``--held-out`` (seeds 10_000 + seed) adds the audit zoo's models
numerics_zoo.HELD_OUT_ZOO (Mistral, Gemma, Phi, BART, Swin, diffusers' VAE and DiT, timm NFNet),
never tuned on. A case that raises is counted and printed, not hidden.

Ground truth: the fp16 overflow sites (module, phase) of the real float16 run (model.half(), same
inputs), one definition shared with forecast (docs/numerics.md): an op that makes +-Inf in a
float16 output from finite inputs holding no float16 limit value (mask fills), where the same op
on the same inputs in float32 stays finite. Forecast's sites: its CW310 findings.
Forward cases compare forward sites (after a forward overflow, a float16 backward is all NaN and
shows nothing); backward and clean cases compare both phases. Recall = true sites forecast
found; precision = forecast sites that are true. Cost: forecast's wall time over a plain float32
forward + backward of the same model (interleaved, medians).

    python benchmarks/bench_numerics_forecast.py [--per-model 8] [--seed 0] [--held-out] [--kinds reduction]
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
from numerics_zoo import MODELS, call, half_inputs, held_out, loss_of

from castwise.numerics import _run
from castwise.numerics.forecast import forecast
from castwise.numerics.observe import _UNINITIALISED, _widen
from castwise.run import Inputs
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


def _hand_rms(g: torch.Tensor) -> torch.Tensor:
    return g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)  # the square overflows in float16


def _upcast_rms(g: torch.Tensor) -> torch.Tensor:
    gf = g.float()  # as transformers' and diffusers' RMSNorms: the square is float32
    return (gf * torch.rsqrt(gf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(g.dtype)


def _upcast_rms_to(g: torch.Tensor) -> torch.Tensor:
    dtype = g.dtype
    gf = g.to(torch.float32)
    return g * torch.rsqrt(gf.pow(2).mean(-1, keepdim=True) + 1e-6).to(dtype)


def _var_norm(g: torch.Tensor) -> torch.Tensor:
    return (g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, keepdim=True) + 1e-5)  # var's output overflows


def _upcast_var_norm(g: torch.Tensor) -> torch.Tensor:
    gf = g.float()
    return ((gf - gf.mean(-1, keepdim=True)) / torch.sqrt(gf.var(-1, keepdim=True) + 1e-5)).type_as(g)


def _sum_f32(g: torch.Tensor) -> torch.Tensor:
    return (g / g.abs().sum(-1, keepdim=True, dtype=torch.float32)).to(g.dtype) * g.shape[-1]


def _sum(g: torch.Tensor) -> torch.Tensor:
    return g / (g.abs().sum(-1, keepdim=True) + 1.0) * g.shape[-1]  # the sum's output overflows


def _layer_norm(g: torch.Tensor) -> torch.Tensor:
    return nn.functional.layer_norm(g, g.shape[-1:])


def _rms_norm(g: torch.Tensor) -> torch.Tensor:
    return nn.functional.rms_norm(g, g.shape[-1:])


def _vector_norm(g: torch.Tensor) -> torch.Tensor:
    return g / (torch.linalg.vector_norm(g, dim=-1, keepdim=True) + 1.0)


def _normalize(g: torch.Tensor) -> torch.Tensor:
    return nn.functional.normalize(g, dim=-1)


def _softmax(g: torch.Tensor) -> torch.Tensor:
    return torch.softmax(g, -1) * g.shape[-1] + torch.log_softmax(g.float(), -1).to(g.dtype).clamp(min=-4)


def _upcast_scores(g: torch.Tensor) -> torch.Tensor:
    gf = g.float()  # diffusers' upcast_attention: the scores in float32
    scores = gf @ gf.transpose(-1, -2) / gf.shape[-1]
    return (torch.softmax(scores, -1) @ gf).to(g.dtype)


def _scores(g: torch.Tensor) -> torch.Tensor:
    scores = g @ g.transpose(-1, -2) / g.shape[-1]  # in float16: the product overflows
    return torch.softmax(scores.float(), -1).to(g.dtype) @ g


REDUCTIONS = (
    _hand_rms,
    _upcast_rms,
    _upcast_rms_to,
    _var_norm,
    _upcast_var_norm,
    _sum_f32,
    _sum,
    _layer_norm,
    _rms_norm,
    _vector_norm,
    _normalize,
    _softmax,
    _upcast_scores,
    _scores,
)


class LargeIntoReduction(nn.Module):
    """A Linear/Conv whose output is scaled to a magnitude within float16's range (2^8.5 to
    2^14.5) and fed to one norm or reduction, hand-written or torch's: whether float16 makes Inf
    there depends on how the op computes (a hand-written square in float16 does, torch's kernels
    and the model's own upcasts do not), then brought back to the output's scale."""

    def __init__(self, inner: nn.Module, scale: float, fn: Any) -> None:
        super().__init__()
        self.inner, self.scale, self.fn = inner, scale, fn

    @property
    def weight(self) -> torch.Tensor:  # T5 reads wo.weight.dtype
        weight: torch.Tensor = self.inner.weight  # type: ignore[assignment]
        return weight

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        h = self.inner(*args, **kwargs)
        return self.fn(h * self.scale) * h.detach().std() + h


def plant_reduction(model: nn.Module, cands: dict[str, tuple[float, float]], rng: random.Random) -> str | None:
    layers = [n for n in sorted(cands) if isinstance(model.get_submodule(n), (nn.Linear, nn.Conv2d, nn.Conv1d))]
    if not layers:
        return None
    name = rng.choice(layers)
    scale = 2.0 ** rng.uniform(8.5, 14.5) / max(cands[name][0], 1e-6)
    parent, _, child = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    setattr(owner, child, LargeIntoReduction(getattr(owner, child), scale, rng.choice(REDUCTIONS)))
    return name


def truth(model: nn.Module, inputs: Any) -> set[tuple[str, str]]:
    sites = OverflowSites()
    half = model.half()
    with _run.kept_as_is(half):
        _run.traced(half, _run.Capture(half), Inputs.of(half_inputs(inputs)).real("cpu"), "train", "cpu", [sites])
    return sites.sites


class SaturateGrad(torch.autograd.Function):
    """Identity forward; backward: the gradient clamped to float16's range (Inf saturates)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.clamp(-F16_MAX, F16_MAX)


def _island(half: nn.Module, wide: dict[str, torch.Tensor], name: str) -> None:
    """``name`` fixed as castwise's CW310 fix says (keep[name]=f32): its float32 weights (from
    ``wide``, by qualified name), its inputs cast to float32, its output cast back to float16
    saturating at +-65504."""
    sub = half.get_submodule(name)
    if getattr(sub, "_bench_island", False):
        return
    prefix = f"{name}." if name else ""
    with torch.no_grad():
        for key, t in (*sub.named_parameters(remove_duplicate=False), *sub.named_buffers(remove_duplicate=False)):
            if t.is_floating_point():
                t.data = wide[prefix + key].clone()
    inner = sub.forward

    def up(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float16:
            return x
        # the gradient leaves the island saturated too (a float16 cast of it would be Inf)
        return SaturateGrad.apply(x.float()) if x.requires_grad else x.float()

    def down(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
            return x.clamp(-F16_MAX, F16_MAX).half()
        return x

    def forward(*a: Any, **k: Any) -> Any:
        a, k = tree_map(up, (a, k))
        return tree_map(down, inner(*a, **k))

    sub.forward = forward  # type: ignore[method-assign]
    sub._bench_island = True  # type: ignore[assignment]


def param_sites(model: nn.Module) -> set[str]:
    """Modules holding a finite parameter or buffer past float16's range (Inf once cast)."""
    out = set()
    for name, module in model.named_modules():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            finite = t.is_floating_point() and t.numel() and bool(torch.isfinite(t).all())
            if finite and float(t.detach().abs().max()) > F16_MAX:
                out.add(name)
    return out


def _unplant(half: nn.Module, orig: dict[str, torch.Tensor], name: str) -> None:
    """The fault planted in ``name`` taken out: its own weights as built, its own forward."""
    sub = half.get_submodule(name)
    prefix = f"{name}." if name else ""
    with torch.no_grad():
        for key, t in (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)):
            if t.is_floating_point():
                t.data = orig[prefix + key].to(t.dtype)
    sub.__dict__.pop("forward", None)


def truth_every_site(
    model: nn.Module,
    inputs: Any,
    orig: dict[str, torch.Tensor],
    planted: set[str],
    phases: tuple[str, ...] = ("forward",),
    rounds: int = 8,
) -> set[tuple[str, str]]:
    """Every site of ``phases``, each made the first in turn: the float16 run again with the
    sites found so far fixed, until no new one shows. A site in a planted module is fixed by
    taking the fault out (``orig``: the weights as built); any other by an island (_island:
    float32 inside, values and gradients leaving it saturated). Parameters and buffers past the
    range are sites of their module (a float16 copy of them is Inf)."""
    # no copy of the model: a planted forward is a closure over the module it was planted in
    wide = {
        k: v.detach().clone()
        for k, v in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    }
    found = {(n, "forward") for n in param_sites(model)}
    half = model.half()

    def fix(name: str) -> None:
        if name in planted:
            _unplant(half, orig, name)
        elif name:
            _island(half, wide, name)

    for name, _ in found:
        fix(name)
    for _ in range(rounds):
        sites = OverflowSites()
        with _run.kept_as_is(half):
            args = Inputs.of(half_inputs(inputs)).real("cpu")
            _run.traced(half, _run.Capture(half), args, "train", "cpu", [sites])
        new = {s for s in sites.sites if s[1] in phases} - found
        if not new:
            break
        found |= new
        for name, _ in new:
            fix(name)
    return found


def plant_many(model: nn.Module, inputs: Any, rng: random.Random, n: int) -> list[str]:
    """Up to ``n`` forward faults, one after another, each in a Linear/Conv whose output is still
    within range in float32 after the ones before (so downstream sites too)."""
    planted: list[str] = []
    for _ in range(n):
        cands = {k: v for k, v in candidates(model, inputs).items() if 0 < v[0] < F16_MAX / 4 and k not in planted}
        got = plant(model, "forward", cands, rng)
        if not got:  # its weight would pass the range itself: the module's output scaled instead
            layers = sorted(k for k in cands if isinstance(model.get_submodule(k), (nn.Linear, nn.Conv1d, nn.Conv2d)))
            if not layers:
                continue
            got = rng.choice(layers)
            module = model.get_submodule(got)
            factor = F16_MAX * 2.0 ** rng.uniform(0.2, 3.0) / cands[got][0]
            module.forward = _scaled(module.forward, factor)  # type: ignore[method-assign]
        planted.append(got)
    return planted


def _scaled(inner: Any, factor: float) -> Any:
    def forward(*a: Any, **k: Any) -> Any:
        return inner(*a, **k) * factor

    return forward


def plant_param(model: nn.Module, rng: random.Random) -> str | None:
    """A weight past float16's range (x1e6 or so): Inf once the model is cast."""
    layers = sorted(n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)))
    if not layers:
        return None
    name = rng.choice(layers)
    weight: Any = model.get_submodule(name).weight
    with torch.no_grad():
        weight.mul_(F16_MAX * 2.0 ** rng.uniform(0.5, 4.0) / float(weight.abs().max()))
    return name


def cost(model: nn.Module, inputs: Any, repeats: int = 5) -> float:
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
    model, inputs = {**MODELS, **held_out()}[model_name]()
    # an output that is all zeros (NFNet's zero-initialised gains) cannot be scaled to overflow
    cands = {k: v for k, v in candidates(model, inputs).items() if v[0] > 0}
    if not cands:
        return None
    orig = {
        k: v.detach().clone()
        for k, v in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    }
    planted: Any
    if kind == "multi":
        planted = plant_many(model, inputs, rng, rng.choice((2, 3)))
    elif kind == "reduction":
        planted = plant_reduction(model, cands, rng)
        kind = f"reduction:{model.get_submodule(planted).fn.__name__}" if planted else kind
    elif kind == "param":
        planted = [n for n in [plant_param(model, rng), *plant_many(model, inputs, rng, 1)] if n]
    else:
        planted = plant(model, kind, cands, rng)
    if not planted and planted != "":
        return None
    report = forecast(model, inputs, target="f16", verify=False)  # the sites only: no verifying runs
    predicted = {(f.module or "", dict(f.details)["phase"]) for f in report.findings if f.code == "CW310"}
    names = set(planted) if isinstance(planted, list) else {planted}
    # forward faults: forward sites (a float16 backward after a forward overflow is all NaN)
    phases = ("forward", "backward") if kind in ("backward", "clean") else ("forward",)
    real = truth_every_site(model, inputs, orig, names, phases)
    predicted = {s for s in predicted if s[1] in phases}
    return {"model": model_name, "kind": kind, "planted": planted, "predicted": predicted, "real": real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-model", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="score an unseen set (seeds 10_000 + seed)")
    parser.add_argument("--models", default="", help="default: the models (--held-out: and those held out)")
    parser.add_argument("--kinds", default="", help="only these case kinds (comma-separated)")
    parser.add_argument("--verbose", action="store_true", help="print every case")
    parser.add_argument("--no-cost", action="store_true", help="score the sites only (no timing)")
    args = parser.parse_args()
    seed = args.seed + (10_000 if args.held_out else 0)
    models = {**MODELS, **held_out()}
    names = args.models.split(",") if args.models else [*MODELS, *(held_out() if args.held_out else ())]
    kinds = ("forward", "backward", "clean", "multi", "param", "multi", "reduction", "reduction")
    rows = []
    ratios = {}
    errors = 0
    for m_index, model_name in enumerate(names):
        rng = random.Random(seed * 1000 + m_index)
        for i in range(args.per_model):
            kind = kinds[i % len(kinds)]
            if args.kinds and kind not in args.kinds.split(","):
                rng.random()  # the other kinds' cases draw what they would have
                continue
            try:
                row = one_case(model_name, kind, rng)
            except Exception as exc:  # counted, not hidden: the benchmark goes on with the next case
                print(f"ERROR {model_name} {kind}: {type(exc).__name__}: {exc}", flush=True)
                errors += 1
                continue
            if row is not None:
                rows.append(row)
                if row["predicted"] != row["real"] or args.verbose:
                    print("DIFF", row, flush=True)
        if not args.no_cost:
            # one thread: on a shared, loaded machine a second one spins against other processes
            # and a toy model's plain step goes from milliseconds to seconds
            torch.set_num_threads(1)
            torch.manual_seed(seed)
            model, inputs = models[model_name]()
            ratios[model_name] = cost(model, inputs)
    tp = sum(len(r["predicted"] & r["real"]) for r in rows)
    n_real = sum(len(r["real"]) for r in rows)
    n_pred = sum(len(r["predicted"]) for r in rows)
    n_models = len({r["model"] for r in rows})
    print(
        f"\nforecast(f16) vs a real float16 run: {len(rows)} cases across {n_models} models (seed {seed}"
        f"{', held-out' if args.held_out else ''}), {n_real} real overflow sites"
    )
    for kind in dict.fromkeys(kinds):
        sub = [r for r in rows if r["kind"].split(":")[0] == kind]
        k_tp = sum(len(r["predicted"] & r["real"]) for r in sub)
        print(
            f"  {kind:9s} {len(sub):3d} cases  real sites {sum(len(r['real']) for r in sub):3d}  "
            f"forecast {sum(len(r['predicted']) for r in sub):3d}  both {k_tp:3d}"
        )
    print(f"cases that raised: {errors}")
    print(f"recall:    {tp}/{n_real} = {tp / max(n_real, 1):.1%} (target >= 95%)")
    print(f"precision: {tp}/{n_pred} = {tp / max(n_pred, 1):.1%} (target >= 90%)")
    for name, ratio in ratios.items():
        print(f"  cost {name:26s} forecast / plain f32 step = {ratio:.2f}x")
    if ratios:
        print(f"forecast cost, median over models: {statistics.median(ratios.values()):.2f}x a plain run")


if __name__ == "__main__":
    main()
