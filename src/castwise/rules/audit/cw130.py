"""CW130 model-raised: The model raised an error that is not about dtypes."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule, Diag
from castwise.rules.audit._text import (
    where,
)

META = Rule(
    code="CW130",
    name="model-raised",
    category=None,
    severity="error",
    summary="The model raised an error that is not about dtypes.",
    detects="The model's forward or backward raised an exception castwise does not "
    "recognise as a dtype problem (shapes, missing arguments...).",
    why="It is reported as what it is, not hidden or mislabelled.",
    example="model(torch.randn(2, 7))  # expects 8 features",
    fix="Fix the error the message names; then re-run the audit.",
)


def diagnose(*, module: str, op: str | None, exc: BaseException) -> Diag:
    """The model raised something that is not a dtype error: reported with the exception kept whole."""
    text = f"{type(exc).__name__}: {exc}"
    return Diag(
        "CW130",
        module,
        op,
        None,
        f"{where(module)} raised {text} (not a dtype problem as far as castwise can tell).",
        "Fix the error the message names, then re-run the audit.",
    )


RULE = AuditRule(META)
