"""A numerics run the model itself could not finish: the audit's diagnosis instead of a traceback.

compare, tune, forecast and locate run the model for real (a float32 reference, the policy).
When the model raises there (a dtype bug of its own, a shape error), the user gets what
``castwise.audit`` says about that model under that run's policy: the module, the origin of the
odd dtype and the fix, with the run that raised named in the message.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from torch import nn

from castwise.errors import CastwiseError
from castwise.report import Finding, Report


class RunRaised(CastwiseError):
    """The model raised in one of the numerics' own runs (``run`` names it: "the float32
    reference run (32-true)"); ``policy`` is what that run applied (None: the model as it is)."""

    def __init__(self, run: str, policy: Any, exc: BaseException) -> None:
        super().__init__(f"{run} raised {type(exc).__name__}: {exc}")
        self.run, self.policy, self.exc = run, policy, exc


@contextlib.contextmanager
def raised_in(run: str, policy: Any) -> Iterator[None]:
    """Exceptions of the model's own code, raised in ``run``, as ``RunRaised`` (castwise's own
    errors and interrupts pass as they are)."""
    try:
        yield
    except CastwiseError:
        raise
    except Exception as exc:
        raise RunRaised(run, policy, exc) from exc


def _audit_errors(model: nn.Module, inputs: Any, policy: Any, device: str | None, mode: str) -> list[Finding]:
    """The audit's error findings under ``policy``: fake tensors first (fast, any size), real
    ones when the fake run saw nothing (a value-dependent failure)."""
    from castwise.auditor.session import check_args, run_audit

    try:
        pol, dev = check_args(model, policy, device, mode, True)
        for fake in (True, False):
            report, _ = run_audit(model, inputs, pol, dev, mode, fake)
            errors = [f for f in report.findings if f.level == "error"]
            if errors:
                return errors
    except CastwiseError:  # a policy or device the audit does not take: the fallback says it
        return []
    return []


def diagnosed(
    model: nn.Module, inputs: Any, raised: RunRaised, *, mode: str, device: str | None = None, audit: bool = True
) -> list[Finding]:
    """The findings for a run that raised: the audit's (module, origin, fix), each saying which
    run raised; a CW130 with the exception's text where the audit finds no error itself (or
    ``audit`` is False: the run was not ``model(inputs)``, e.g. a training step's replay)."""
    errors = _audit_errors(model, inputs, raised.policy, device, mode) if audit else []
    lead = f"{raised.run[0].upper()}{raised.run[1:]} raised here; the audit of it: "
    if errors:
        return [dataclasses.replace(f, message=lead + f.message) for f in errors]
    from castwise.rules.audit import cw130
    from castwise.trace.events import as_mode

    d = cw130.diagnose(module="", op=None, exc=raised.exc)
    return [Finding(code=d.code, message=lead + d.message, module=None, modes=(as_mode(mode),), fix=d.fix)]


def add_diagnosis(
    report: Report,
    model: nn.Module,
    inputs: Any,
    raised: RunRaised,
    *,
    mode: str,
    device: str | None,
    audit: bool = True,
) -> Report:
    """``report`` (of a run that stopped where the model raised) with the audit's findings added
    first: what the user has to fix before any number of the run means much."""
    report.findings[:0] = diagnosed(model, inputs, raised, mode=mode, device=device, audit=audit)
    return report
