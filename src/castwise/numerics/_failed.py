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

from castwise.errors import CastwiseError
from castwise.report import Finding, Report
from castwise.run import RunRequest


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


def _audit_errors(request: RunRequest, policy: Any) -> list[Finding]:
    """The audit's error findings for ``request`` under ``policy`` (the run's that raised): fake
    tensors first (fast, any size), real ones when the fake run saw nothing (a value-dependent
    failure). The same parsed inputs: the audit calls the model as the numerics run did."""
    from castwise.auditor.session import run_request
    from castwise.run import check

    r = request
    try:
        req = check("audit", r.model, r.inputs, policy=policy, device=r.device, mode=r.mode)
        for fake in (True, False):
            report, _ = run_request(dataclasses.replace(req, fake=fake))
            errors = [f for f in report.findings if f.level == "error"]
            if errors:
                return errors
    except CastwiseError:  # a policy or device the audit does not take: the fallback says it
        return []
    return []


def diagnosed(request: RunRequest, raised: RunRaised, *, audit: bool = True) -> list[Finding]:
    """The findings for a run of ``request`` that raised: the audit's (module, origin, fix), each
    saying which run raised; a CW130 with the exception's text where the audit finds no error
    itself (or ``audit`` is False: the run was not ``model(inputs)``, e.g. a training step's replay)."""
    errors = _audit_errors(request, raised.policy) if audit else []
    lead = f"{raised.run[0].upper()}{raised.run[1:]} raised here; the audit of it: "
    if errors:
        return [dataclasses.replace(f, message=lead + f.message) for f in errors]
    from castwise.rules.audit import cw130
    from castwise.trace.events import as_mode

    d = cw130.diagnose(module="", op=None, exc=raised.exc)
    return [Finding(code=d.code, message=lead + d.message, module=None, modes=(as_mode(request.mode),), fix=d.fix)]


def add_diagnosis(report: Report, request: RunRequest, raised: RunRaised, *, audit: bool = True) -> Report:
    """``report`` (of a run that stopped where the model raised) with the audit's findings added
    first: what the user has to fix before any number of the run means much."""
    report.findings[:0] = diagnosed(request, raised, audit=audit)
    return report
