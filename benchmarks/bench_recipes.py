"""The recipe benchmark: zoo models x the training recipes people really run (own autocast,
gradient checkpointing, Lightning precisions with CastwiseCallback, Accelerate, LoRA over a bf16
base, torchao float8 emulated) x device (cpu, simulated cuda), truth from the real CPU run.

Each case is the recipe's code around a zoo model (benchmarks/recipes/recipes.py), run for real
on CPU (train: forward + backward; eval: no_grad; a Lightning recipe: one ``trainer.fit`` step
and ``trainer.validate``) and audited by castwise (``castwise.audit``; a Lightning recipe: the
``CastwiseCallback`` in the same fit on CPU, and ``castwise.audit(policy="lightning:<precision>",
device="cuda")`` for the simulated GPU). The zoo's scoring rule decides each half's outcome:
false error / missed / crash / incomplete / ok (benchmarks/recipes/cases.py). The simulated-CUDA
half takes the CPU run as its truth (no GPU here; the recipes' dtype logic does not depend on the
device) and is scored for false errors, crashes and incompleteness only. Planted faults (the
zoo's fault classes, benchmarks/zoo/faults.py) go into the recipes on CPU: detection rate and
origin-right rate. ``--truth cuda`` (a machine with a GPU): the simulated-CUDA half is scored
against the same recipe run for real on the CUDA device (model and inputs moved there; a
Lightning recipe on a ``accelerator="gpu"`` Trainer), misses included.

    python benchmarks/bench_recipes.py [--models llama,gpt2] [--recipes autocast-bf16,...]
        [--faults-per-recipe 3] [--limit N] [--jobs 1|2] [--truth cpu|cuda] [--out recipes.json]
    python benchmarks/bench_recipes.py --from recipes.json   # the tables again
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.recipes.cases import DEVICES, TRUTHS, RecipeCase, evaluate, fault_cases  # noqa: E402
from benchmarks.recipes.recipes import MODELS, RECIPES  # noqa: E402
from benchmarks.recipes.table import print_tables  # noqa: E402
from benchmarks.zoo.cases import quiet  # noqa: E402
from benchmarks.zoo.faults import NotApplicable  # noqa: E402


def _one(job: tuple[RecipeCase, tuple[str, ...], int, str]) -> dict[str, Any]:
    case, devices, timeout, truth = job
    quiet()
    if case.fault is not None:
        devices = ("cpu",)  # a planted fault's truth is the CPU's
    try:
        return evaluate(case, devices, timeout, truth)
    except NotApplicable as exc:
        return {"case": asdict(case), "not_applicable": str(exc)}
    except Exception as exc:  # a harness failure is reported, never hidden in a score
        return {
            "case": asdict(case),
            "harness_error": f"{case}: {type(exc).__name__}: {exc}",
            "trace": traceback.format_exc(limit=4)[-1200:],
        }


def run(
    work: list[RecipeCase], pool: Any, timeout: int, devices: tuple[str, ...] = DEVICES, truth: str = "cpu"
) -> list[dict[str, Any]]:
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    items = [(c, devices, timeout, truth) for c in work]
    iterator: Any = pool.imap(_one, items) if pool else map(_one, items)
    for n, record in enumerate(iterator, 1):
        results.append(record)
        if n % 10 == 0:
            print(f"  {n}/{len(work)} cases, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return results


def _names(text: str | None, valid: Any, what: str, parser: argparse.ArgumentParser) -> list[str]:
    names = list(valid) if text is None else [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(valid))
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; valid: {', '.join(valid)}")
    return names


def _check_cuda_truth(opts: argparse.Namespace, devices: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    import torch

    if not torch.cuda.is_available():
        parser.error("--truth cuda: no CUDA device (torch.cuda.is_available() is False); use --truth cpu here")
    if "cuda" not in devices:
        parser.error("--truth cuda scores the simulated-CUDA half: --devices must include cuda")
    if opts.jobs > 1:
        parser.error("--truth cuda runs with --jobs 1 (CUDA cannot be used in forked workers)")
    print(f"truth: real CUDA on {torch.cuda.get_device_name()}, torch {torch.__version__}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated (default: {len(MODELS)} models)")
    parser.add_argument("--recipes", help=f"comma-separated, from: {', '.join(RECIPES)}")
    parser.add_argument("--devices", default=",".join(DEVICES), help="cpu, cuda (simulated), or both")
    parser.add_argument("--faults-per-recipe", type=int, default=3, help="planted-fault cases per recipe")
    parser.add_argument("--limit", type=int, help="at most this many clean cases (then the planted ones)")
    parser.add_argument("--jobs", type=int, default=1, choices=[1, 2])
    parser.add_argument(
        "--truth",
        default="cpu",
        choices=TRUTHS,
        help="the simulated-CUDA half's truth: the real CPU run (default) or the recipe run on the CUDA device",
    )
    parser.add_argument("--timeout", type=int, default=120, help="seconds per audit before it counts as a crash")
    parser.add_argument("--out", type=Path, help="write the per-case results as JSON here")
    parser.add_argument("--from", dest="source", type=Path, nargs="+", help="print the tables of saved --out files")
    opts = parser.parse_args(argv)
    if opts.source is not None:
        print_tables([r for path in opts.source for r in json.loads(path.read_text())["results"]])
        return 0
    models = _names(opts.models, MODELS, "model(s)", parser)
    recipes = _names(opts.recipes, RECIPES, "recipe(s)", parser)
    if "float8-emulated" not in RECIPES:
        print("torchao is not installed: the float8-emulated recipe is left out", file=sys.stderr)
    devices = tuple(_names(opts.devices, DEVICES, "device(s)", parser))
    if opts.truth == "cuda":
        _check_cuda_truth(opts, devices, parser)
    start = time.perf_counter()
    # the workers are forked before this process runs any torch op: a fork after torch has
    # started its thread pools hangs the children
    pool = multiprocessing.get_context("fork").Pool(opts.jobs, maxtasksperchild=20) if opts.jobs > 1 else None
    try:
        work = [RecipeCase(m, r) for m in models for r in recipes][: opts.limit]
        args = (models, recipes, opts.faults_per_recipe)
        work += pool.apply(fault_cases, args) if pool else fault_cases(*args)
        results = run(work, pool, opts.timeout, devices, opts.truth)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    print(
        f"recipes: {len(work)} cases ({len(models)} models x {len(recipes)} recipes, "
        f"{sum(c.fault is not None for c in work)} planted), {time.perf_counter() - start:.0f} s "
        f"with {opts.jobs} job(s)"
    )
    summary = print_tables(results)
    if opts.out is not None:
        opts.out.write_text(json.dumps({"summary": summary, "results": results}, indent=1, default=str))
        print(f"per-case results: {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
