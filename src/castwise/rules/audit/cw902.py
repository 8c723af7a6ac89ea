"""CW902 fake-run-incomplete: the fake run stopped at an op fake tensors cannot run."""

from __future__ import annotations

from castwise.rules._rule import Rule
from castwise.rules.audit._base import AuditRule, Diag
from castwise.rules.audit._text import (
    where,
)

META = Rule(
    code="CW902",
    name="fake-run-incomplete",
    category=None,
    severity="warning",
    summary="The fake-tensor run stopped at an op fake tensors cannot run; later ops were not checked.",
    detects="An op raised inside the fake-tensor machinery (no fake kernel, a data-dependent "
    "shape or value such as `.item()` or `nonzero`), so the rest of the model did not run.",
    why="Silence would read as 'no problem found'; the audit says where it stopped instead.",
    example="if mask.any(): ...  # needs a value fake tensors do not have",
    fix="Audit with `--real` (fake=False) on a small configuration of the model.",
)


def diagnose(
    *, module: str, op: str | None, text: str, cuda_limit: bool, data_dependent: bool, simulated_cuda: bool
) -> Diag:
    """The fake run stopped at ``op`` in ``module`` for a reason of the simulation, not the model."""
    where_ = f"{op or 'an op'} in {where(module)}"
    if cuda_limit:
        why = (
            f"it needed the real CUDA runtime, which a simulated CUDA device does not have ({text}): a "
            "limit of the simulation, not an error in the model"
        )
    elif data_dependent:
        why = (
            f"it needs a tensor's values (`.item()`, `if x.any():`, `nonzero`...), which fake tensors do not "
            f"have ({text}): a limit of the simulation, not an error in the model"
        )
    else:
        why = f"fake tensors cannot run it ({text}): a limit of the simulation, not an error in the model"
    return Diag(
        "CW902",
        module,
        op,
        None,
        f"PART OF THE MODEL WAS NOT CHECKED. The fake-tensor run stopped at {where_}: {why}. No op after it "
        "was checked, so this report cannot say the rest is free of dtype errors.",
        "Check the rest on real tensors: `castwise audit <file.py:build> --real` (`fake=False` in "
        "castwise.audit) on a small configuration of the model (real CPU tensors, same policy)"
        + (" with device='cpu'" if simulated_cuda else "")
        + ".",
    )


RULE = AuditRule(META)
