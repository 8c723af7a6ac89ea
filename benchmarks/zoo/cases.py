"""One benchmark case: a zoo model in a situation, optionally with a planted fault, seeded.

Every run of a case (the audit, each real mode, the fix verification) gets a fresh build from
the same seed: identical weights, inputs and fault place, and nothing one run did (hooks fired,
BatchNorm statistics, an applied policy) leaks into the next.
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from benchmarks.zoo import models
from benchmarks.zoo.faults import FAULTS, NotApplicable, PlantedFault
from benchmarks.zoo.scoring import (
    MODES,
    AuditOutcome,
    DtypeFlops,
    RealOutcome,
    Score,
    audit_outcome,
    errors_in,
    hooks_cast_back,
    low_share,
    real_compiled_run,
    real_run,
    run_mode,
    score,
)
from benchmarks.zoo.situations import SITUATIONS
from torch import nn


@dataclass(frozen=True)
class Case:
    model: str
    situation: str
    fault: str | None
    seed: int


def quiet() -> None:
    """Silence the libraries' configuration chatter (the benchmark prints tables)."""
    warnings.filterwarnings("ignore")
    import importlib

    for name in ("transformers", "diffusers"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name).logging.set_verbosity_error()


def build_case(case: Case) -> tuple[nn.Module, Any, PlantedFault | None]:
    model, inputs = models.build(case.model, case.seed)
    model, inputs = SITUATIONS[case.situation].prepare(model, inputs)
    planted = None
    if case.fault is not None:
        planted = FAULTS[case.fault].plant(model, random.Random(case.seed))
    return model, inputs, planted


def verify_fix(
    case: Case, policy: str | None, cast_back: frozenset[str] = frozenset()
) -> tuple[bool, str, float | None]:
    """Whether the real CPU run passes in both modes under ``policy`` applied to fresh builds
    (None: the model as it is), with the hooks named in ``cast_back`` returning their results in
    the dtype they were given (a hook code fix), and the share of matmul/conv FLOPs that ran in
    the situation's low-precision dtype."""
    for mode in MODES:
        model, inputs, _ = build_case(case)
        with hooks_cast_back(model, cast_back):
            outcome = real_run(model, inputs, policy, mode)
        if outcome.status != "ok":
            return False, f"{mode}: {outcome.message}", None
    low = SITUATIONS[case.situation].low
    if low is None:
        return True, "", None
    import castwise

    model, inputs, _ = build_case(case)
    if policy is not None:
        castwise.apply(model, policy)
    counter = DtypeFlops()
    try:
        with counter, hooks_cast_back(model, cast_back):
            run_mode(model, inputs, "train")
    except Exception:  # the count is a measurement only: a mode that refuses it gives no share
        return True, "", None
    return True, "", low_share(dict(counter.by_dtype), low)


def _finding_summary(audit: AuditOutcome) -> list[dict[str, Any]]:
    return [
        {
            "code": f.code,
            "level": f.level,
            "modes": list(f.modes),
            "module": f.module,
            "origin": f.origin_module,
            "culprits": list(f.culprits),
            "message": f.message[:400],
        }
        for f in audit.findings
    ][:6]


def evaluate(
    case: Case, *, fix: bool = True, timeout: int = 120, compiled: bool = False, real_compiled: bool = False
) -> dict[str, Any]:
    """Audit the case, run it for real in both modes, score; verify the suggested fix.
    ``compiled``: audit ``torch.compile(model)``; the real runs stay eager unless
    ``real_compiled``: then they run the compiled program (Inductor), what a user of the compiled
    model meets."""
    quiet()
    start = time.perf_counter()
    situation = SITUATIONS[case.situation]
    model, inputs, planted = build_case(case)
    audit = audit_outcome(model, inputs, situation.policy, timeout, compiled=compiled)
    real: dict[str, RealOutcome] = {}
    for mode in MODES:
        m, x, _ = build_case(case)
        real[mode] = (real_compiled_run if real_compiled else real_run)(m, x, situation.policy, mode)
    s: Score = score(real, audit, planted.expected_origin if planted else None)
    record: dict[str, Any] = {
        "case": asdict(case),
        "planted": asdict(planted) if planted else None,
        "real": {m: asdict(r) for m, r in real.items()},
        "audit": {
            "status": audit.status,
            "ok": audit.ok,
            "incomplete": audit.incomplete,
            "seconds": round(audit.seconds, 3),
            "suggested_policy": audit.suggested_policy,
            "message": audit.message,
            "findings": _finding_summary(audit),
            "compiled_graphs": audit.compiled_graphs,
            "orig_mod_named": audit.orig_mod_named,
        },
        "score": asdict(s),
        "fix": None,
    }
    has_errors = any(errors_in(audit, m) for m in MODES)
    # a code fix castwise verified (a hook's result cast back) is applied to the real run too,
    # under the suggested policy if there is one (castwise verified it under that), else the user's
    hooks = frozenset(f.hook for f in audit.findings if f.code_fix_verified and f.hook)
    if fix and s.detected and audit.suggested_policy is not None and not hooks:
        verified, why, share = verify_fix(case, audit.suggested_policy)
        record["fix"] = {"policy": audit.suggested_policy, "verified": verified, "why": why, "low_share": share}
    elif fix and s.detected and hooks:
        policy = audit.suggested_policy or situation.policy
        verified, why, share = verify_fix(case, policy, hooks)
        code = [f.code_fix for f in audit.findings if f.code_fix_verified]
        record["fix"] = {"policy": policy, "code_fix": code, "verified": verified, "why": why, "low_share": share}
    elif fix and has_errors:
        why = "no suggested policy or verified code fix"
        record["fix"] = {"policy": None, "verified": False, "why": why, "low_share": None}
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def fault_class(index: int) -> str:
    """The fault class of the ``index``-th fault case (classes in turn, in name order)."""
    classes = sorted(FAULTS)
    return classes[index % len(classes)]


def fault_case(index: int, heldout: bool, tries: int = 12) -> Case | None:
    """The ``index``-th fault case: fault classes in turn, a seeded model and situation, the first
    model (in the seeded order) that has a place for the fault. None: no model has one."""
    fault = FAULTS[fault_class(index)]
    seed = (100_000 if heldout else 0) + index
    rng = random.Random(seed)
    zoo = [m.name for m in models.models(heldout=heldout)]
    rng.shuffle(zoo)
    for name in zoo[:tries]:
        case = Case(name, rng.choice(fault.situations), fault.name, seed)
        torch.manual_seed(seed)
        try:
            build_case(case)
        except NotApplicable:
            continue
        return case
    return None
