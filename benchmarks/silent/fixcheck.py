"""The fix column of a silent case: the audit's CW14x findings (per device, fake tensors) with their fixes
verified for real by ``castwise.numerics.silent.verify_fixes`` on the case's own real inputs (the
policy plus the finding's clause, run against float32; verified at >= 4x lower error). A planted
case's fix is verified when the finding at its op (scoring.at_op) says so."""

from __future__ import annotations

import time
import traceback
from typing import Any

from benchmarks.silent.cases import Case
from benchmarks.silent.scoring import SILENT_CODES, Seen, at_op


def score_fix(case: Case, device: str = "cpu") -> dict[str, Any]:
    import castwise
    from castwise.numerics.silent import verify_fixes

    built = case.build()
    start = time.perf_counter()
    try:
        report = castwise.audit(built.model, built.inputs, policy=case.policy, device=device, mode="train")
        report = verify_fixes(built.model, built.inputs, report, policy=case.policy, mode="train", device=device)
    except Exception as exc:  # a crash is scored (not verified), never hidden
        return {"status": "crash", "verified": False, "message": f"{exc!r} {traceback.format_exc(limit=3)[-600:]}"}
    rows = []
    for f in report.findings:
        if f.code not in SILENT_CODES:
            continue
        d = dict(f.details)
        o = f.origin
        seen = Seen(f.code, f.op, f.module, o.module if o else None, o.tensor if o else None)
        rows.append(
            {
                "code": f.code,
                "module": f.module,
                "op": f.op,
                "at_op": case.expect is not None and at_op(seen, case.expect),
                "verified": bool(d.get("fix_verified")),
                "clause": d.get("fix_policy"),
                "reduction": d.get("error_reduction"),
                "why": d.get("fix_check"),
            }
        )
    hits = [r for r in rows if r["at_op"]]
    return {
        "status": "done",
        "verified": any(r["verified"] for r in hits),
        "findings": rows,
        "seconds": time.perf_counter() - start,
    }


def fix_line(fix: dict[str, Any]) -> str:
    """The column: ``fix Y (clause, 12x)``, ``fix -`` or ``fix crash``."""
    if fix["status"] != "done":
        return "fix crash"
    hit = next((r for r in fix["findings"] if r["at_op"] and r["verified"]), None)
    if hit is None:
        return "fix -"
    return f"fix Y ({hit['clause']}, {hit['reduction']}x)"


def fix_summary(fixes: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "cases": len(fixes),
        "verified": sum(f["verified"] for f in fixes),
        "crashes": sum(f["status"] != "done" for f in fixes),
    }
