"""``CastwiseCallback``: audit a LightningModule under the Trainer's precision before training.

At fit start (before the sanity check and the first training step) the callback audits the
module's ``training_step`` (train mode, with backward) and ``validation_step`` (eval mode,
under no_grad) on fake tensors with a batch from the train dataloader, under the Trainer's
precision string and device. An error finding stops the fit with ``CastwiseAuditError``, whose
message names the module and the fix; with ``fix=True`` the suggested policy is applied to the
module and the fit goes on. Lightning's own precision plugin still does its job (autocast,
input conversion): castwise adds the fp32 islands, output casts and fast-path setting.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from castwise.errors import CastwiseError, PolicyError
from castwise.integrations._steps import CastwiseAuditError, GatedCallback, StepModule, unwrap_report
from castwise.policy import Policy

__all__ = ["CastwiseAuditError", "CastwiseCallback"]


def _train_step(module: Any, batch: Any) -> Any:
    return module.training_step(batch, 0)


def _eval_step(module: Any, batch: Any) -> Any:
    if type(module).validation_step is pl.LightningModule.validation_step:
        return module.training_step(batch, 0)  # no validation_step: eval runs the training step
    return module.validation_step(batch, 0)


def _first_batch(trainer: pl.Trainer) -> Any:
    source = getattr(trainer.fit_loop, "_data_source", None)
    loader = source.dataloader() if source is not None and source.is_defined() else None
    if loader is None:
        raise CastwiseError("CastwiseCallback needs a train dataloader to take a batch from; none is attached")
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    if isinstance(loader, dict):
        loader = next(iter(loader.values()))
    return next(iter(loader))


class CastwiseCallback(GatedCallback, pl.Callback):
    """Audit the LightningModule at fit start; stop on an error, or ``fix=True`` to apply the
    suggested policy and continue. ``mode``: which loops to audit ("both", "train", "eval").
    ``watch``: also watch every training step's loss (``castwise.watch``); the first non-finite
    one is replayed under ``castwise.locate_nonfinite`` and raises ``NonfiniteError`` (or
    ``"warn"``, or a callable given the report)."""

    def __init__(self, fix: bool = False, mode: str = "both", watch: Any = False) -> None:
        super().__init__(fix, mode)
        self.watch = watch
        self._watch: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.watch and self._watch is None:
            from castwise.numerics.watch import StepWatch

            self._watch = StepWatch(pl_module, "raise" if self.watch is True else self.watch,
                                    lambda m, b, i: m.training_step(b, i), trainer.precision_plugin.train_step_context)
        if self._watch is not None:
            self._watch.begin(batch, batch_idx)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self._watch is not None:
            trainer_ref, pl_module._trainer = pl_module._trainer, None  # the replay's self.log stays out of it
            try:
                self._watch.check(loss)
            finally:
                pl_module._trainer = trainer_ref

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from castwise.auditor import audit

        # Lightning's meaning of its precision strings (its *-true convert norms too)
        precision = f"lightning:{trainer.precision}"
        try:
            Policy.parse(precision)
        except PolicyError as exc:
            rank_zero_warn(f"CastwiseCallback: not auditing, castwise does not model this precision: {exc}")
            return
        device = trainer.strategy.root_device.type
        batch = _first_batch(trainer)
        trainer_ref = pl_module._trainer
        training = pl_module.training
        # the audit copies the module: detach the trainer so it is not copied with it (self.log
        # without a trainer only warns)
        pl_module._trainer = None
        try:
            wrapper = StepModule(pl_module, _train_step, _eval_step)
            report = unwrap_report(audit(wrapper, (batch,), policy=precision, device=device, mode=self.mode))
        finally:
            pl_module._trainer = trainer_ref
            pl_module.train(training)
        self._gate.act(report, pl_module, "fit")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._gate.restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._gate.restore()
