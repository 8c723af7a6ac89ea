"""Scoring a silent case's audit: a planted case is found at its op when a finding with a code in
CW140-CW149 names the expected op (any of its spellings) in the expected module (or a module
inside it), and at its origin when that finding's origin (module, or the tensor it names: a
buffer, an input) is the expected one. A control is clean when no CW14x finding is reported."""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass
from typing import Any

from benchmarks.silent.cases import Case, Expect

SILENT_CODES = frozenset(f"CW{n}" for n in range(140, 150))


@dataclass(frozen=True)
class Seen:
    """One CW14x finding, as the scorer reads it."""

    code: str
    op: str | None
    module: str | None
    origin_module: str | None
    origin_tensor: str | None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def op_name(op: str | None) -> str:
    """``aten._log_softmax.default``, ``aten::_log_softmax``, ``_log_softmax`` -> ``_log_softmax``."""
    if not op:
        return ""
    name = op.split("::")[-1]
    parts = name.split(".")
    if parts[0] in ("aten", "prims", "torch", "ops"):
        parts = parts[1:]
    return parts[0] if parts else ""


def _inside(module: str | None, expected: str) -> bool:
    return module is not None and (module == expected or module.startswith(expected + "."))


def _names(text: str | None, token: str) -> bool:
    """``token`` as a whole name (or a dotted prefix of one) in a tensor description."""
    return bool(text) and re.search(rf"(?<![\w.]){re.escape(token)}(?![\w])", text or "") is not None


def at_op(seen: Seen, expect: Expect) -> bool:
    return op_name(seen.op) in expect.ops and _inside(seen.module, expect.module)


def at_origin(seen: Seen, expect: Expect) -> bool:
    return any(_inside(seen.origin_module, t) or _names(seen.origin_tensor, t) for t in expect.origin)


def silent_findings(report: Any) -> list[Seen]:
    out = []
    for f in report.findings:
        if f.code in SILENT_CODES:
            origin = f.origin
            out.append(
                Seen(
                    f.code,
                    f.op,
                    f.module,
                    origin.module if origin else None,
                    origin.tensor if origin else None,
                )
            )
    return out


@dataclass(frozen=True)
class AuditScore:
    device: str
    status: str  # done | crash
    found_op: bool = False
    found_origin: bool = False
    clean: bool = True  # no CW14x finding at all
    seen: tuple[Seen, ...] = ()
    seconds: float = 0.0
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in vars(self).items() if k != "seen"}, "seen": [s.to_dict() for s in self.seen]}


def score_audit(case: Case, device: str) -> AuditScore:
    """Audit the case's model as its user wrote it, under its policy, on fake tensors for ``device``."""
    import castwise

    built = case.build()
    start = time.perf_counter()
    try:
        report = castwise.audit(built.model, built.inputs, policy=case.policy, device=device)
    except Exception as exc:  # a crash is scored (never found), never hidden
        tail = traceback.format_exc(limit=3)[-600:]
        return AuditScore(device, "crash", seconds=time.perf_counter() - start, message=f"{exc!r} {tail}")
    seconds = time.perf_counter() - start
    seen = tuple(silent_findings(report))
    if case.expect is None or device not in case.expect.devices:
        return AuditScore(device, "done", clean=not seen, seen=seen, seconds=seconds)
    hits = [s for s in seen if at_op(s, case.expect)]
    return AuditScore(
        device,
        "done",
        found_op=bool(hits),
        found_origin=any(at_origin(s, case.expect) for s in hits),
        clean=not seen,
        seen=seen,
        seconds=seconds,
    )
