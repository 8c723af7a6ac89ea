"""CW121 train-eval-divergence: The model passes in one mode and fails in the other."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.api import Finding, Session
from castwise.rules.audit._base import AuditRule
from castwise.rules.audit._text import (
    where,
)

META = Rule(
    code="CW121",
    name="train-eval-divergence",
    category="FASTPATH_BYPASSES_AUTOCAST",
    severity="warning",
    summary="The model passes in one mode and fails in the other.",
    detects="The audit runs train (forward+backward) and eval (no_grad); one is clean and the other has errors.",
    why="Training may run for hours before the first validation step crashes.",
    example="nn.TransformerEncoder under bf16-mixed: train passes, eval fails.",
    fix="See the error finding of the failing mode; the suggested policy fixes both.",
)


def _scan(session: Session) -> list[Finding]:
    if len(session.runs) != 2:
        return []
    modes = [r.mode for r in session.runs]
    errors = {m: [f for f in session.findings if f.level == "error" and m in f.modes] for m in modes}
    bad = [m for m, errs in errors.items() if errs]
    if len(bad) != 1:
        return []
    good = next(m for m in errors if m not in bad)
    first = errors[bad[0]][0]
    return [
        Finding(
            code="CW121",
            module=first.module,
            op=first.op,
            origin=first.origin,
            modes=(bad[0],),
            message=(
                f"The model passes in {good} mode and fails in {bad[0]} mode ({first.code} at "
                f"{where(first.module or '')}): "
                + (
                    "training runs, and the first validation step crashes."
                    if bad[0] == "eval"
                    else "validation runs, and training crashes."
                )
            ),
            fix=f"See the {first.code} finding; the suggested policy fixes both modes.",
        )
    ]


RULE = AuditRule(META, scan=_scan)
