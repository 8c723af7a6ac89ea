"""``castwise.watch``: a training loop's first non-finite step, replayed under locate_nonfinite.

While armed, watch does per step only what costs nothing measurable: it wraps the model's
``forward`` (one Python call), keeps a reference to the step's inputs and a copy of the random
state (a few kilobytes), and looks at the loss the model returns (or its outputs), or at a loss
or gradient norm the loop hands to ``check``. No per-op hook runs. On the first non-finite
step it replays that step (same inputs, random state, weights, autocast: the optimizer has not
stepped yet) under :func:`castwise.locate_nonfinite` and acts: raise, warn, or a callback.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise import _autocast
from castwise.errors import CastwiseError
from castwise.report import Finding, Report

ACTIONS = ("raise", "warn")


class NonfiniteError(CastwiseError, FloatingPointError):
    """Raised by ``watch`` (``on_nonfinite="raise"``) at the first non-finite step, with the
    replay's report (``.report``) naming the op that made the NaN/Inf."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class _Step:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    autocast: _autocast.AutocastState
    number: int


def _is_nonfinite(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return (
            x.is_floating_point()
            and x.numel() > 0
            and not math.isfinite(
                float(x.detach().sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32))
            )
        )
    if isinstance(x, float):
        return not math.isfinite(x)
    return False


def _loss_of(out: Any) -> Any:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is not None:
        return loss
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((x for x in out if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
    return None


class Watch:
    """The armed watch (see :func:`watch`). ``report``: the replay's report once a step went
    non-finite; ``steps``: the training steps seen."""

    def __init__(
        self, model: nn.Module, on_nonfinite: str | Callable[[Report], Any], replay: Any, check_outputs: bool
    ) -> None:
        if not isinstance(model, nn.Module):
            raise CastwiseError(f"watch needs a torch.nn.Module, got {type(model).__name__}")
        if not callable(on_nonfinite) and on_nonfinite not in ACTIONS:
            raise CastwiseError(
                f"on_nonfinite={on_nonfinite!r} is not valid; valid: {', '.join(ACTIONS)} or a "
                "callable taking the Report"
            )
        self.model = model
        self.on_nonfinite = on_nonfinite
        self.replay_fn = replay
        self.check_outputs = check_outputs
        self.report: Report | None = None
        self.steps = 0
        self._last: _Step | None = None
        self._replaying = False
        self._had_forward: Any = None
        self._armed = False

    # -- arming --------------------------------------------------------------------------------

    def __enter__(self) -> Watch:
        model = self.model
        self._had_forward = model.__dict__.get("forward")
        inner = model.forward  # the bound method (or a wrapper someone already set)
        watch = self

        def forward(self_: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if watch._replaying or not self_.training or not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            watch.record(args, kwargs)
            out = inner(*args, **kwargs)
            if watch.check_outputs and watch.report is None and _is_nonfinite(_loss_of(out)):
                watch.fire("the model's loss/outputs")
            return out

        model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
        self._armed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._armed:
            return
        if self._had_forward is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self._had_forward  # type: ignore[method-assign]
        self._armed = False
        self._last = None

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep what a replay of this step needs: references to its inputs, the random state."""
        self.steps += 1
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        self._last = _Step(args, kwargs, torch.get_rng_state(), cuda, _autocast.AutocastState.capture(), self.steps)

    # -- checking ------------------------------------------------------------------------------

    def check(
        self,
        loss: Any = None,
        *,
        grad_norm: Any = None,
        replay: Callable[[nn.Module], Any] | None = None,
    ) -> Report | None:
        """Look at a loss and/or a gradient norm the loop computed anyway (call it before
        ``optimizer.step()``); on the first non-finite one, replay the step and act. ``replay``:
        how the step computes its loss from the model (``lambda m: criterion(m(x), y)``), when
        the loss is not the model's own output. Returns the replay's report, or None."""
        if self.report is not None:
            return None
        for what, value in (("loss", loss), ("gradient norm", grad_norm)):
            if value is not None and _is_nonfinite(value):
                return self.fire(f"the {what}", replay)
        return None

    def fire(self, what: str, replay: Callable[[nn.Module], Any] | None = None) -> Report | None:
        step = self._last
        if step is None:
            raise CastwiseError(
                "watch saw a non-finite value but no training forward ran while it was armed: "
                "call the model inside `with castwise.watch(model):` in train mode"
            )
        report = self._replay(step, replay or self.replay_fn)
        self.report = report
        message = (
            f"castwise.watch: {what} went non-finite at step {step.number}; the replay (same inputs, random "
            f"state and weights, before the optimizer step) says:\n{report}"
        )
        if callable(self.on_nonfinite):
            self.on_nonfinite(report)
        elif self.on_nonfinite == "warn":
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        else:
            self.__exit__(None, None, None)  # the loop stops here: leave the model as it was
            raise NonfiniteError(message, report)
        return report

    def _replay(self, step: _Step, replay: Callable[[nn.Module], Any] | None) -> Report:
        from castwise.numerics.locate import locate_in
        from castwise.run import Inputs, RunRequest, model_device

        now_rng = torch.get_rng_state()
        now_autocast = _autocast.AutocastState.capture()
        self._replaying = True
        try:
            torch.set_rng_state(step.rng)
            if step.cuda_rng is not None:
                torch.cuda.set_rng_state_all(step.cuda_rng)
            step.autocast.restore()
            # the step's own call, as it was made (no rule of what a batch means applies)
            inputs = Inputs.called(step.args, step.kwargs) if replay is None else Inputs.of(())
            request = RunRequest(self.model, inputs, None, model_device(self.model), "train", False)
            fn: Callable[..., Any] | None = None if replay is None else (lambda m, *a, **k: replay(m))
            report = locate_in(request, fn)
        finally:
            self._replaying = False
            now_autocast.restore()
            torch.set_rng_state(now_rng)
        if not report.findings:
            report.findings.append(
                Finding(
                    code="CW305",
                    module="",
                    modes=("train",),
                    message=(
                        f"Step {step.number} went non-finite, but its replay (same inputs, random state and weights) "
                        "made no NaN/Inf in the model's ops."
                    ),
                )
            )
        return report


def watch(
    model: nn.Module,
    *,
    on_nonfinite: str | Callable[[Report], Any] = "raise",
    replay: Callable[[nn.Module], Any] | None = None,
    check_outputs: bool = True,
) -> Watch:
    """A context manager for a training loop: ``with castwise.watch(model) as w: ...``.

    While open, every training-mode forward of ``model`` (grad enabled) is recorded (input
    references, random state, autocast state) and its loss, or its outputs when it returns no
    loss, is checked; ``w.check(loss, grad_norm=...)`` checks values the loop computed itself
    (before ``optimizer.step()``). The first non-finite step is replayed under
    :func:`castwise.locate_nonfinite` and ``on_nonfinite`` acts: ``"raise"`` (NonfiniteError
    with the report), ``"warn"``, or a callable given the Report. ``replay``: how the step
    computes its loss from the model when the loss is computed outside it
    (``lambda m: criterion(m(x), y)``); by default the recorded forward is replayed.
    """
    return Watch(model, on_nonfinite, replay, check_outputs)


class StepWatch:
    """``watch=True`` on a trainer callback: ``begin`` at each training batch (inputs, random
    state), ``check`` on the loss the trainer hands to its hooks anyway. ``step(module, batch,
    index)`` is how the trainer runs a step (a LightningModule's ``training_step``); ``context()``
    the context it runs it in (the trainer's autocast), re-entered for the replay."""

    def __init__(
        self,
        model: nn.Module,
        on_nonfinite: str | Callable[[Report], Any],
        step: Callable[[Any, Any, int], Any],
        context: Callable[[], Any] | None = None,
    ) -> None:
        self.watch = Watch(model, on_nonfinite, None, check_outputs=False)
        self.step = step
        self.context = context
        self._batch: tuple[Any, int] | None = None

    @property
    def report(self) -> Report | None:
        return self.watch.report

    def begin(self, batch: Any, index: int) -> None:
        self._batch = (batch, index)
        self.watch.record((batch,), {})

    def check(self, loss: Any) -> Report | None:
        if self.watch.report is not None or self._batch is None or not _is_nonfinite(loss):
            return None
        batch, index = self._batch
        step = self.step

        def replay(m: nn.Module) -> Any:
            return step(m, batch, index)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the replayed step's own logging without a trainer
            if self.context is None:
                return self.watch.fire("the training step's loss", replay)
            with self.context():
                return self.watch.fire("the training step's loss", replay)
