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
    detects="An op raised inside the fake-tensor machinery (no fake kernel, values read outside torch "
    "such as `.numpy()`, the real CUDA runtime), or a non-dtype error followed values the run had to "
    "assume (CW903), so the rest of the model did not run.",
    why="Silence would read as 'no problem found'; the audit says where it stopped instead.",
    example="keep = int(x.detach().numpy().sum())  # values read outside torch: fake tensors have none",
    fix="Audit with `--real` (fake=False) on a small configuration of the model.",
)


def diagnose(
    *,
    module: str,
    op: str | None,
    text: str,
    cuda_limit: bool,
    data_dependent: bool,
    simulated_cuda: bool,
    assumed: bool = False,
    own_mode: bool = False,
) -> Diag:
    """The fake run stopped at ``op`` in ``module`` for a reason of the simulation, not the model
    (``assumed``: after it took values fake tensors do not have as assumed, CW903)."""
    where_ = f"at {op} in {where(module)}" if op else f"in {where(module)}"
    if assumed:
        why = (
            f"it raised {text} after the run assumed values fake tensors do not have (listed in CW903): "
            "with the real values it may not, so it is not reported as an error in the model"
        )
    elif own_mode:
        why = (
            f"the model's own torch.compile (flex_attention's) refuses to run under castwise's tracer ({text}): "
            "a limit of the audit, not an error in the model"
        )
    elif cuda_limit:
        why = (
            f"it needed the real CUDA runtime, which a simulated CUDA device does not have ({text}): a "
            "limit of the simulation, not an error in the model"
        )
    elif data_dependent:
        why = (
            f"it needs a tensor's values (read through `.numpy()`, or a size no assumption could give), which "
            f"fake tensors do not have ({text}): a limit of the simulation, not an error in the model"
        )
    else:
        why = f"fake tensors cannot run it ({text}): a limit of the simulation, not an error in the model"
    return Diag(
        "CW902",
        module,
        op,
        None,
        f"PART OF THE MODEL WAS NOT CHECKED. The {'' if own_mode else 'fake-tensor '}run stopped {where_}: {why}. "
        "No op after it was checked, so this report cannot say the rest is free of dtype errors.",
        "Check the rest on real tensors: `castwise audit <file.py:build> --real` (`fake=False` in "
        "castwise.audit) on a small configuration of the model (real CPU tensors, same policy)"
        + (" with device='cpu'" if simulated_cuda else "")
        + ".",
    )


RULE = AuditRule(META)


def compiled_stopped(error: str, graphs: int, fullgraph: bool) -> Diag:
    """A compiled run that torch.compile itself stopped (no dtype refusal of the model's): the
    compiled program was checked only as far as it got."""
    # under fullgraph=True Dynamo refuses any graph break: the user's own compile stops there too
    hint = " Under fullgraph=True, a graph break stops the real torch.compile as well." if fullgraph else ""
    return Diag(
        "CW902",
        "",
        None,
        None,
        f"PART OF THE COMPILED PROGRAM WAS NOT CHECKED. torch.compile stopped in the compiled run "
        f"after {graphs} graph(s): {error}.{hint} The eager run of this mode was checked in full.",
        "Run torch.compile on the model for real (a small configuration, CPU) to see whether it "
        "fails the same way; where it does, fix what torch.compile names (fullgraph=False lets Dynamo "
        "break the graph there).",
        compiled_only=True,
    )
