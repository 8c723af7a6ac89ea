"""CW125 compiled-runs-what-eager-refuses: the eager program refuses an op the compiled one runs."""

from __future__ import annotations

import dataclasses

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule, Diag
from castwise.rules.audit._text import (
    where,
)

META = Rule(
    code="CW125",
    name="compiled-runs-what-eager-refuses",
    category=None,
    severity="warning",
    summary="A torch.compile'd model runs an op whose dtypes its eager program refuses.",
    detects=(
        "In an audit of torch.compile(model), the eager run refuses an op (an error finding) in a "
        "module whose ops the compiled run of the same mode checked, through to the end, without "
        "any refusal: the graphs torch.compile runs (after Inductor's decompositions, where "
        "Inductor compiles) accept those dtypes. The eager finding becomes this warning."
    ),
    why=(
        "The compiled model trains: reporting an error there would stop a run that works. But "
        "the module still fails wherever it runs eagerly: with torch.compile turned off "
        "(debugging, another backend), at a graph break inside it, or under "
        "torch.compiler.disable."
    ),
    example=(
        "m = torch.compile(model)  # model bf16, one LayerNorm left in f64\n"
        "# warning CW125 at `layer.0.norm`: eager refuses it (aten.native_layer_norm: mixed dtype ...);\n"
        "# the compiled program runs it (Inductor decomposes it into ops that promote)"
    ),
    fix="The eager finding's fix (its message is kept): it makes both programs run.",
)


def diagnose(eager: Diag, decompositions: str | None) -> Diag:
    """The eager error ``eager`` as what only the eager program does."""
    how = (
        "Inductor's decompositions turn it into ops that accept these dtypes"
        if decompositions == "inductor"
        else "its graphs accept these dtypes"
    )
    op = f" ({eager.op})" if eager.op else ""
    message = (
        f"The compiled program runs {where(eager.module)}{op}, which eager refuses ({eager.code}): {how}. "
        f"It fails wherever {where(eager.module)} runs eagerly (torch.compile off, a graph break in "
        f"it, torch.compiler.disable). Eager: {eager.message.rstrip('.')}"
    )
    return dataclasses.replace(
        eager, code="CW125", message=message, details=(*eager.details, ("eager_code", eager.code))
    )


RULE = AuditRule(META)
