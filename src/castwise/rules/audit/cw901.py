"""CW901 op-not-checked: An op ran that castwise could not check against a real kernel's contract."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Session
from castwise.rules.audit._base import AuditRule

META = Rule(
    code="CW901",
    name="op-not-checked",
    category="UNCAST_CUSTOM_OP_OR_EXTENSION",
    severity="info",
    summary="An op ran that castwise could not check against a real kernel's contract.",
    detects="An op without an entry in castwise's dtype-contract table, or without a fake "
    "implementation, ran during the audit.",
    why="The audit says what it did not check instead of passing silently.",
    example="a custom extension op with no fake kernel",
    fix="Audit with `--real` on a small configuration to check it on real tensors.",
)


def _scan(session: Session) -> list[Finding]:
    # ops the contract table does not know
    uncovered: dict[str, set[str]] = {}
    for r in session.runs:
        for op, modules in r.trace.uncovered.items():
            uncovered.setdefault(op, set()).update(modules)
    if not uncovered:
        return []
    ops = sorted(uncovered)
    listed = ", ".join(ops[:12]) + (f" and {len(ops) - 12} more" if len(ops) > 12 else "")
    return [
        Finding(
            code="CW901",
            module=sorted(uncovered[ops[0]])[0],
            op=ops[0],
            modes=tuple(r.mode for r in session.runs),
            message=f"{len(ops)} op(s) ran without a dtype contract to check them against: {listed}.",
            fix="Audit with --real on a small configuration to check them on real kernels.",
            details=(("unchecked_ops", ops),),
        )
    ]


RULE = AuditRule(META, scan=_scan)
