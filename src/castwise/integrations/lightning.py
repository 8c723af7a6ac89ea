"""``CastwiseCallback``: audit a LightningModule under the Trainer's precision before training.

At fit start (before the sanity check and the first training step) the callback audits the
module's ``training_step`` (train mode, with backward) and ``validation_step`` (eval mode,
under no_grad) on fake tensors with a batch from the train dataloader, under the Trainer's
precision string and device. A dtype error stops the fit with ``CastwiseAuditError``, whose
message names the module and the fix; with ``fix=True`` the suggested policy is applied to the
module and the fit goes on. An error that is not about dtypes is left to the step itself to
raise. Lightning's own precision plugin still does its job (autocast, input conversion):
castwise adds the fp32 islands, output casts and fast-path setting. The audit runs under
``lightning:<trainer.precision>``, which models the plugin's step (under ``*-true`` torch's
default dtype is the low dtype while the step runs). Drawing the batch and auditing leave every
random stream as it was, so the fit sees the same batches and reaches the same weights as
without the callback.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from castwise.errors import CastwiseError, PolicyError
from castwise.integrations._steps import (
    CastwiseAuditError,
    GatedCallback,
    audit_or_skip,
    random_streams_kept,
    step_view,
)
from castwise.policy import Policy

__all__ = ["CastwiseAuditError", "CastwiseCallback"]


def _has_validation_step(module: pl.LightningModule) -> bool:
    return type(module).validation_step is not pl.LightningModule.validation_step


def _step(module: Any, batch: Any) -> Any:
    if module.training or not _has_validation_step(module):
        return module.training_step(batch, 0)  # no validation_step: eval runs the training step
    return module.validation_step(batch, 0)


def _no_log(self: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
    """``self.log`` / ``self.log_dict`` in the audit's copy: a fake value has nowhere to go (and
    Lightning warns about a copy without a trainer)."""


def _train_loader(trainer: pl.Trainer) -> Any:
    source = getattr(trainer.fit_loop, "_data_source", None)
    loader = source.dataloader() if source is not None and source.is_defined() else None
    if loader is None:
        raise CastwiseError("CastwiseCallback needs a train dataloader to take a batch from; none is attached")
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    if isinstance(loader, dict):
        loader = next(iter(loader.values()))
    return loader


def _audited(module: pl.LightningModule, mode: str, precision: str) -> str:
    if mode == "train":
        steps = "training_step"
    elif _has_validation_step(module):
        steps = "validation_step" if mode == "eval" else "training_step and validation_step"
    else:
        steps = "training_step in eval mode" if mode == "eval" else "training_step in train and eval mode"
    return f"{steps} under {precision}"


class CastwiseCallback(GatedCallback, pl.Callback):
    """Audit the LightningModule at fit start; stop on a dtype error, or ``fix=True`` to apply
    the suggested policy and continue. ``mode``: which loops to audit ("both", "train", "eval").
    Findings name modules as the LightningModule does (``encoder.layers.0``).
    ``watch``: also watch every training step's loss (``castwise.watch``); the first non-finite
    one is replayed under ``castwise.locate_nonfinite`` and raises ``NonfiniteError`` (or
    ``"warn"``, or a callable given the report)."""

    def __init__(self, *, fix: bool = False, mode: str = "both", watch: Any = False) -> None:
        super().__init__(fix=fix, mode=mode)
        self.watch = watch
        self._watch: Any = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.watch and self._watch is None:
            from castwise.numerics.watch import StepWatch

            self._watch = StepWatch(
                pl_module,
                "raise" if self.watch is True else self.watch,
                lambda m, b, i: m.training_step(b, i),
                trainer.precision_plugin.train_step_context,
            )
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
            f8 = Policy.parse(precision).float8
            if f8 is not None:  # Lightning's float8 is TransformerEngine's; apply converts torchao's recipes
                raise PolicyError(
                    f"{precision!r} trains TransformerEngine's float8 GEMMs ({f8} scaling), which castwise does "
                    "not model (it converts torchao's tensorwise, rowwise and mxfp8 recipes)"
                )
        except PolicyError as exc:
            rank_zero_warn(f"CastwiseCallback: not auditing, castwise does not model this precision: {exc}")
            return
        # the fit goes on as it would without the callback: the batch drawn here, the audit and a
        # second call of a train_dataloader hook leave every random stream as it was
        with random_streams_kept():
            loader = _train_loader(trainer)
            with random_streams_kept(loader):
                batch = next(iter(loader))
            # the audit runs (a copy of) a view of the module whose forward is the step; the
            # view's log methods do nothing, and the module itself is not touched
            view = step_view(pl_module, _step, log=_no_log, log_dict=_no_log)
            device = trainer.strategy.root_device.type
            report = audit_or_skip(
                lambda: audit(view, (batch,), policy=precision, device=device, mode=self.mode),
                f"{type(pl_module).__name__} (CastwiseCallback)",
                log=trainer.is_global_zero,
            )
        if report is None:
            return
        self._gate.act(
            report,
            pl_module,
            where="fit",
            audited=_audited(pl_module, self.mode, str(trainer.precision)),
            log=trainer.is_global_zero,
        )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._gate.restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._gate.restore()
