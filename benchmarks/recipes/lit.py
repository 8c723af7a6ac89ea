"""The Lightning recipe: a zoo model in a LightningModule, fit for one step on CPU by a real
Trainer in one of its low precisions, with or without castwise's ``CastwiseCallback``."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from benchmarks.recipes.wrappers import loss_of
from benchmarks.zoo.scoring import AuditOutcome, RealOutcome, first_line, is_dtype_error, view
from torch import nn


class LitRecipe(pl.LightningModule):
    """The model's loss as ``forward(batch)``; both steps call it (so an audit of the module
    itself, as the callback runs it, sees the step)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, list):  # the loader's conversion turns the zoo's input tuple into a list
            batch = tuple(batch)
        return loss_of(self.model, batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _loader(batch: Any) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader([batch], batch_size=None)  # one batch, as built: no collation


def _trainer(precision: str, callbacks: list[Any], accelerator: str = "cpu") -> pl.Trainer:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "castwise"):
        logging.getLogger(name).setLevel(logging.ERROR)  # the benchmark prints tables, not fit chatter
    warnings.filterwarnings("ignore")
    return pl.Trainer(
        accelerator=accelerator,
        devices=1,
        precision=precision,  # type: ignore[arg-type]  # Lightning's own literal type
        max_steps=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _outcome(exc: BaseException | None) -> RealOutcome:
    if exc is None:
        return RealOutcome("ok")
    status = "dtype_error" if is_dtype_error(exc) else "other_error"
    return RealOutcome(status, f"{type(exc).__name__}: {first_line(exc)}")


@dataclass(frozen=True)
class FitResult:
    outcome: RealOutcome
    weights: dict[str, torch.Tensor] | None  # after the step; None when the fit raised
    audit: AuditOutcome | None = None  # the callback's report, when it ran


def fit(module: LitRecipe, batch: Any, precision: str, with_callback: bool, accelerator: str = "cpu") -> FitResult:
    """One training step (``trainer.fit``), with validation off; with the callback, its report."""
    from castwise.lightning import CastwiseAuditError, CastwiseCallback

    callback = CastwiseCallback(mode="both") if with_callback else None
    trainer = _trainer(precision, [callback] if callback else [], accelerator)
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        trainer.fit(module, train_dataloaders=_loader(batch), val_dataloaders=[])
    except CastwiseAuditError as exc:
        error = exc
    except Exception as exc:
        error = exc
    audit = None
    if callback is not None:
        audit = callback_outcome(callback, error, time.perf_counter() - start)
    weights = None if error is not None else {k: v.detach().clone() for k, v in module.state_dict().items()}
    return FitResult(_outcome(error), weights, audit)


def callback_outcome(
    callback: Any, error: BaseException | None, seconds: float, stopped_by: type | None = None, run: str = "fit"
) -> AuditOutcome:
    """The callback's audit as the zoo scores an audit: its report's findings; a fit that raised
    before the callback had a report is a crash of castwise's (its own error, or the step's that
    the callback let through without auditing)."""
    if stopped_by is None:
        from castwise.lightning import CastwiseAuditError as stopped_by
    report = callback.report
    if report is None:
        why = f"{type(error).__name__}: {first_line(error)}" if error else "the callback did not audit"
        return AuditOutcome("crash", message=why, seconds=seconds)
    incomplete = any(r.status == "incomplete" for r in report.runs) or any(f.code == "CW902" for f in report.findings)
    stopped = isinstance(error, stopped_by)
    return AuditOutcome(
        "done",
        ok=report.ok and not stopped,
        incomplete=incomplete,
        findings=tuple(view(f) for f in report.sorted_findings()),
        suggested_policy=None if report.suggested_policy is None else str(report.suggested_policy),
        message=f"the callback stopped the {run}" if stopped else "",
        seconds=seconds,
    )


def validate(module: LitRecipe, batch: Any, precision: str, accelerator: str = "cpu") -> RealOutcome:
    """The eval truth: ``trainer.validate`` on the batch (no_grad, eval mode), no callback."""
    trainer = _trainer(precision, [], accelerator)
    try:
        trainer.validate(module, dataloaders=_loader(batch), verbose=False)
    except Exception as exc:
        return _outcome(exc)
    return RealOutcome("ok")
