"""What castwise's trainer callbacks share: auditing a framework's steps as a model's forward,
and acting on the report before the first step (stop, apply a fix, or say that all is well)."""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from castwise._state import random_streams_kept as random_streams_kept
from castwise.errors import AuditError, CastwiseError
from castwise.report import Finding, Report

RAISED = "CW130"  # the model raised something that is not a dtype error: the step raises it itself
MODES = ("both", "eval", "train")
_IN_STEP = "_castwise_in_step"
_STEP_SIGNATURE = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("self", "batch")]
)


def step_view(module: nn.Module, step: Callable[[nn.Module, Any], Any], **methods: Callable[..., Any]) -> nn.Module:
    """A stand-in for ``module`` for the audit to copy and run: the same state (shared, not
    copied: the audit makes its own copy), of a subclass whose ``forward(batch)`` runs
    ``step(self, batch)`` and whose ``methods`` replace the module's own. The step's own
    ``self(...)`` calls get the module's forward (an instance ``forward``, such as an applied
    policy's, included). Module names stay the module's own (a wrapper module would prefix each
    with its attribute name); the user's object is not touched."""
    cls = type(module)
    state = dict(module.__dict__)
    own = state.pop("forward", None)  # castwise.apply's wrapper, bound to the module

    def module_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if isinstance(own, types.MethodType) and own.__self__ is module:
            return own.__func__(self, *args, **kwargs)  # bound to the audit's copy, not the user's module
        if own is not None:
            return own(*args, **kwargs)
        return cls.forward(self, *args, **kwargs)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get(_IN_STEP):
            return module_forward(self, *args, **kwargs)
        self.__dict__[_IN_STEP] = True
        try:
            return step(self, *args, **kwargs)
        finally:
            del self.__dict__[_IN_STEP]

    # the audit names the inputs after forward's parameters ("batch[0]")
    forward.__signature__ = _STEP_SIGNATURE  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {
        "forward": forward,
        **methods,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    view: nn.Module = object.__new__(type(cls.__name__, (cls,), namespace))
    for name, value in state.items():
        if isinstance(value, types.MethodType) and value.__self__ is module:
            # bound to the view, a deepcopy rebinds it to the copy (bound to the module, it
            # would copy the module a second time and run that)
            state[name] = types.MethodType(value.__func__, view)
    view.__dict__.update(state)
    return view


def audit_or_skip(run_audit: Callable[[], Report], what: str, log: bool = True) -> Report | None:
    """The callback's audit, or None where castwise cannot audit ``what`` (an ``AuditError``: a
    model it cannot copy, a setup it does not read). That is said in one warning and the run
    goes on as without the callback: castwise's own limit never stops a user's run."""
    try:
        return run_audit()
    except AuditError as exc:
        if log:
            logger().warning("castwise: %s not audited, the run goes on: %s", what, exc)
        return None


def logger() -> logging.Logger:
    """The "castwise" logger. With no logging configured at all, it gets a stderr handler at
    INFO (as Lightning does for its own logger), so the callbacks' one line is seen."""
    log = logging.getLogger("castwise")
    if not log.hasHandlers():
        log.addHandler(logging.StreamHandler())
        if log.level == logging.NOTSET:  # a level the user set stays
            log.setLevel(logging.INFO)
        log.propagate = False  # a root handler configured later would print each line twice
    return log


def _at(module: str | None) -> str:
    return f"`{module}`" if module else "the model's top level"


def _places(findings: list[Finding]) -> str:
    return ", ".join(f"{f.code} at {_at(f.module).strip('`')}" for f in findings)


def error_message(report: Report, where: str, owner: str) -> str:
    errors = [f for f in report.errors if f.code != RAISED]
    lines = [f"castwise stopped the {where}: the audit found {len(errors)} dtype error(s) before the first step."]
    for f in errors:
        origin = f" (dtype from {f.origin})" if f.origin else ""
        modes = f" [{', '.join(f.modes)}]" if f.modes else ""
        lines.append(f"- {f.code} at {_at(f.module)}{modes}{origin}: {f.message}")
        lines.append(f"  fix: {f.fix or f.rule.fix}")
    for f in report.errors:
        if f.code == RAISED:
            lines.append(f"The audit also saw an error that is not about dtypes ({f.code}): {f.message}")
    if report.suggested_policy is not None:
        lines.append(
            f"A policy that passes the audit: {report.suggested_policy!s} ({owner}(fix=True) applies it and goes on)."
        )
    return "\n".join(lines)


class CastwiseAuditError(CastwiseError, RuntimeError):
    """Raised by castwise's trainer callbacks to stop training whose audit found dtype errors."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


class AuditGate:
    """Act on an audit report before the first step: stop on a dtype error, or with ``fix``
    apply the suggested policy; an error that is not about dtypes is left to the step to raise
    (the user's own exception and traceback, untouched). One log line says what happened. The
    gate also keeps the fast-path flag set for the run (trainers call step methods, not
    ``forward``, so apply's forward wrapper cannot do it)."""

    def __init__(self, fix: bool, owner: str) -> None:
        self.fix = fix
        self.owner = owner
        self.report: Report | None = None
        self.applied: Any = None
        self._fastpath_before: bool | None = None

    def act(self, report: Report, model: nn.Module, *, where: str, audited: str, log: bool) -> None:
        """``where``: what stops ("fit"); ``audited``: what ran, for the log line ("training_step
        and validation_step under bf16-mixed"); ``log``: this process logs (rank zero)."""
        self.report = report
        errors = [f for f in report.errors if f.code != RAISED]
        raised = [f for f in report.errors if f.code == RAISED]
        if errors and (not self.fix or report.suggested_policy is None):
            raise CastwiseAuditError(error_message(report, where, self.owner), report)
        if errors:
            self._apply(report.suggested_policy, model)
            if log:
                logger().info(
                    "castwise: applied suggested policy %s (fixes %s)", report.suggested_policy, _places(errors)
                )
        elif raised:
            if log:
                logger().warning(
                    "castwise: audited %s: %s castwise does not stop the %s for an error that is not about dtypes; "
                    "the code after it was not audited.",
                    audited,
                    raised[0].message,
                    where,
                )
        elif log:
            others = sorted({f.code for f in report.findings})
            more = f" ({', '.join(others)}: see {self.owner}.report)" if others else ""
            # CW902: the fake run stopped early; what it did not reach was not checked
            reached = " in the part the audit could run" if "CW902" in others else ""
            logger().info("castwise: audited %s: no dtype errors%s%s", audited, reached, more)

    def _apply(self, policy: Any, model: nn.Module) -> None:
        from castwise.applied import apply

        self.applied = apply(model, policy)
        if not policy.fastpath:
            self._fastpath_before = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)

    def restore(self) -> None:
        if self._fastpath_before is not None:
            torch.backends.mha.set_fastpath_enabled(self._fastpath_before)
            self._fastpath_before = None


class GatedCallback:
    """The callbacks' shared surface: ``fix``, ``mode``, and the ``report`` / ``applied`` of
    their audit gate. Parameters are keyword-only."""

    def __init__(self, *, fix: bool = False, mode: str = "both") -> None:
        super().__init__()  # the framework's callback base comes next in the MRO
        if mode not in MODES:
            raise CastwiseError(f"{type(self).__name__}(mode={mode!r}): not a mode; valid modes: {', '.join(MODES)}")
        self.fix = fix
        self.mode = mode
        self._gate = AuditGate(fix, type(self).__name__)

    @property
    def report(self) -> Report | None:
        """The audit's report, once training has started."""
        return self._gate.report

    @property
    def applied(self) -> Any:
        """The ``Applied`` policy when ``fix=True`` applied one, else None."""
        return self._gate.applied
