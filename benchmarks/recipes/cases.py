"""One recipe case: a model under a recipe (optionally with a planted fault), its truth from the
real CPU run of the same recipe, and castwise's audit of it on CPU and on a simulated CUDA device.

Outcome of each half (the zoo's scoring rule, benchmarks/zoo/scoring.py, decides each part):
crash (castwise raised or timed out), false error (an error finding in a mode where the real run
passed), missed (the real run failed with a dtype error, no error finding), incomplete (the audit
could not check the whole model), else ok. The simulated-CUDA half has no CUDA truth on this
machine: it takes the CPU run as the truth where the recipe's dtype logic does not depend on the
device, and is scored only for crashes, incompleteness and false errors (a miss is not scored).
With ``truth="cuda"`` (a machine with a GPU) the simulated-CUDA half is scored against the same
recipe run for real on the CUDA device instead, misses included.
"""

from __future__ import annotations

import random
import time
import types
from dataclasses import asdict, dataclass
from typing import Any

import torch
from benchmarks.recipes.recipes import RECIPES, build
from benchmarks.zoo.faults import FAULTS, NotApplicable, PlantedFault
from benchmarks.zoo.scoring import MODES, AuditOutcome, RealOutcome, Score, audit_outcome, real_run, score
from torch import nn
from torch.utils._pytree import tree_map_only

DEVICES = ("cpu", "cuda")
TRUTHS = ("cpu", "cuda")


@dataclass(frozen=True)
class RecipeCase:
    model: str
    recipe: str
    fault: str | None = None
    seed: int = 0


def build_case(case: RecipeCase) -> tuple[nn.Module, Any, PlantedFault | None]:
    """A fresh build: the model, the recipe around it, the fault planted (names as the audit
    sees them: relative to what the user runs)."""
    recipe = RECIPES[case.recipe]
    model, inputs = build(case.model, case.seed)
    planted = None
    if case.fault is not None and recipe.plant_first:
        planted = FAULTS[case.fault].plant(model, random.Random(case.seed))
    module, inputs = recipe.prepare(model, inputs)
    if case.fault is not None and not recipe.plant_first:
        planted = FAULTS[case.fault].plant(module, random.Random(case.seed))
    return module, inputs, planted


def outcome(s: Score, device: str, truth: str = "cpu") -> str:
    if s.crash:
        return "crash"
    if s.false_alarm_modes:
        return "false_error"
    if s.missed and (device == "cpu" or truth == "cuda"):
        return "missed"
    if s.incomplete:
        return "incomplete"
    if all(status == "other_error" for status in s.real.values()):
        return "unscored"  # the real run failed for a reason that is not about dtypes
    return "ok"


def _audit_view(audit: AuditOutcome) -> dict[str, Any]:
    return {
        "status": audit.status,
        "ok": audit.ok,
        "incomplete": audit.incomplete,
        "seconds": round(audit.seconds, 3),
        "message": audit.message,
        "findings": [
            {
                "code": f.code,
                "level": f.level,
                "modes": list(f.modes),
                "module": f.module,
                "origin": f.origin_module,
                "message": f.message[:300],
            }
            for f in audit.findings
        ][:6],
    }


def real_cuda_run(case: RecipeCase, mode: str) -> RealOutcome:
    """The recipe run for real on the CUDA device: the model and its inputs moved there."""
    module, inputs, _ = build_case(case)
    module = module.to("cuda")  # keeps each parameter's dtype: the recipe's casts stay
    inputs = tree_map_only(torch.Tensor, lambda t: t.to("cuda"), inputs)
    result = real_run(module, inputs, None, mode)
    try:
        torch.cuda.synchronize()  # an asynchronous kernel error surfaces here
    except RuntimeError as exc:
        return RealOutcome("other_error", f"{type(exc).__name__}: {exc}"[:300])
    return result


def _code_recipe(
    case: RecipeCase, devices: tuple[str, ...], timeout: int, truth: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    real = {}
    for mode in MODES:
        module, inputs, _ = build_case(case)
        real[mode] = real_run(module, inputs, None, mode)
    real_cuda = {mode: real_cuda_run(case, mode) for mode in MODES} if truth == "cuda" and "cuda" in devices else {}
    audits = {}
    for device in devices:
        module, inputs, _ = build_case(case)
        audits[device] = audit_outcome(module, inputs, None, timeout, device=None if device == "cpu" else device)
    return real, audits, real_cuda


def _lightning_recipe(
    case: RecipeCase, devices: tuple[str, ...], timeout: int, truth: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    from benchmarks.recipes import lit

    precision = RECIPES[case.recipe].lightning
    assert precision is not None
    module, batch, _ = build_case(case)
    plain = lit.fit(module, batch, precision, with_callback=False)  # type: ignore[arg-type]
    module, batch, _ = build_case(case)
    real = {"train": plain.outcome, "eval": lit.validate(module, batch, precision)}  # type: ignore[arg-type]
    audits: dict[str, AuditOutcome] = {}
    extra: dict[str, Any] = {}
    if "cpu" in devices:
        module, batch, _ = build_case(case)
        with_cb = lit.fit(module, batch, precision, with_callback=True)  # type: ignore[arg-type]
        assert with_cb.audit is not None
        audits["cpu"] = with_cb.audit
        if plain.weights is not None and with_cb.weights is not None:
            # the callback must leave the fit as it was: the same weights after the step
            extra["fit_same"] = all(torch.equal(plain.weights[k], with_cb.weights[k]) for k in plain.weights)
    if "cuda" in devices:  # what the callback audits on a GPU trainer
        module, batch, _ = build_case(case)
        audits["cuda"] = audit_outcome(module, (batch,), f"lightning:{precision}", timeout, device="cuda")
    real_cuda = {}
    if truth == "cuda" and "cuda" in devices:  # the same fit and validation on a GPU trainer
        module, batch, _ = build_case(case)
        real_cuda["train"] = lit.fit(module, batch, precision, with_callback=False, accelerator="gpu").outcome  # type: ignore[arg-type]
        module, batch, _ = build_case(case)
        real_cuda["eval"] = lit.validate(module, batch, precision, accelerator="gpu")  # type: ignore[arg-type]
    return real, audits, extra, real_cuda


def _hf_recipe(case: RecipeCase, devices: tuple[str, ...], timeout: int, truth: str) -> tuple[dict[str, Any], ...]:
    from benchmarks.recipes import hf

    precision = RECIPES[case.recipe].trainer
    assert precision is not None
    module, batch, _ = build_case(case)
    plain = hf.fit(module, batch, precision, with_callback=False)
    module, batch, _ = build_case(case)
    real = {"train": plain.outcome, "eval": hf.evaluate_eval(module, batch, precision)}
    audits: dict[str, AuditOutcome] = {}
    extra: dict[str, Any] = {}
    if "cpu" in devices:
        module, batch, _ = build_case(case)
        with_cb = hf.fit(module, batch, precision, with_callback=True)
        assert with_cb.audit is not None
        audits["cpu"] = with_cb.audit
        if plain.weights is not None and with_cb.weights is not None:
            extra["fit_same"] = all(torch.equal(plain.weights[k], with_cb.weights[k]) for k in plain.weights)
    if "cuda" in devices:  # what the callback audits on a GPU trainer
        from castwise.integrations.transformers import trainer_precision

        policy = trainer_precision(types.SimpleNamespace(bf16=precision == "bf16", fp16=precision == "fp16"))
        module, batch, _ = build_case(case)
        audits["cuda"] = audit_outcome(module, batch, policy, timeout, device="cuda")
    real_cuda = {}
    if truth == "cuda" and "cuda" in devices:  # the same Trainer step and eval on the GPU
        module, batch, _ = build_case(case)
        real_cuda["train"] = hf.fit(module, batch, precision, with_callback=False, use_cpu=False).outcome
        module, batch, _ = build_case(case)
        real_cuda["eval"] = hf.evaluate_eval(module, batch, precision, device="cuda")
    return real, audits, extra, real_cuda


def evaluate(
    case: RecipeCase, devices: tuple[str, ...] = DEVICES, timeout: int = 120, truth: str = "cpu"
) -> dict[str, Any]:
    """Run the case for real (truth), audit it on each device, score each half; ``truth="cuda"``:
    the simulated-CUDA half against the recipe run for real on the CUDA device."""
    with RECIPES[case.recipe].session():
        return _evaluate(case, devices, timeout, truth)


def _evaluate(case: RecipeCase, devices: tuple[str, ...], timeout: int, truth: str) -> dict[str, Any]:
    start = time.perf_counter()
    torch.manual_seed(case.seed)
    _, _, planted = build_case(case)  # NotApplicable surfaces here, before any run
    extra: dict[str, Any] = {}
    if RECIPES[case.recipe].trainer:
        real, audits, extra, real_cuda = _hf_recipe(case, devices, timeout, truth)
    elif RECIPES[case.recipe].lightning:
        real, audits, extra, real_cuda = _lightning_recipe(case, devices, timeout, truth)
    else:
        real, audits, real_cuda = _code_recipe(case, devices, timeout, truth)
    halves = {}
    for device, audit in audits.items():
        truth_here = real_cuda if device == "cuda" and real_cuda else real
        s = score(truth_here, audit, planted.expected_origin if planted else None)
        halves[device] = {"outcome": outcome(s, device, truth), "score": asdict(s), "audit": _audit_view(audit)}
    return {
        "case": asdict(case),
        "truth": truth,
        "planted": asdict(planted) if planted else None,
        "real": {m: asdict(r) for m, r in real.items()},
        **({"real_cuda": {m: asdict(r) for m, r in real_cuda.items()}} if real_cuda else {}),
        "halves": halves,
        **extra,
        "seconds": round(time.perf_counter() - start, 3),
    }


def fault_cases(models: list[str], recipes: list[str], per_recipe: int, seed: int = 0) -> list[RecipeCase]:
    """Seeded planted-fault cases: for each recipe, ``per_recipe`` (model, fault class) draws whose
    fault class makes sense under the recipe and has a place in the model."""
    out = []
    for r, name in enumerate(recipes):
        situation = RECIPES[name].faults
        classes = sorted(f for f, fc in FAULTS.items() if situation in fc.situations)
        rng = random.Random(seed * 1000 + r)
        found = 0
        for i in range(per_recipe * 6):
            if found == per_recipe:
                break
            case = RecipeCase(rng.choice(models), name, classes[i % len(classes)], seed * 1000 + r * 100 + i)
            try:
                with RECIPES[name].session():
                    build_case(case)
            except (NotApplicable, KeyError):  # no place for it (a wrapper's delegated ``bias``)
                continue
            out.append(case)
            found += 1
    return out


def real_failed(record: dict[str, Any]) -> bool:
    return any(r["status"] == "dtype_error" for r in record["real"].values())


__all__ = [
    "DEVICES",
    "TRUTHS",
    "RealOutcome",
    "RecipeCase",
    "build_case",
    "evaluate",
    "fault_cases",
    "outcome",
    "real_failed",
]
