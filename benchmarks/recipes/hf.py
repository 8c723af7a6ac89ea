"""The HF Trainer recipe: a zoo model trained one step by a real ``transformers.Trainer`` on CPU
with ``bf16=True`` or ``fp16=True`` (Accelerate's autocast around the forward, its outputs
converted to f32), with or without castwise's ``CastwiseTrainerCallback``.

The loss is the benchmark's (an f32 sum of the first output, as the zoo's real run), through
``compute_loss``, so every zoo model trains whether or not it returns a loss; the loader gives
the zoo's batch as built (no collation), as the Lightning recipe does."""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from typing import Any

import torch
from benchmarks.recipes.lit import FitResult, _outcome, callback_outcome
from benchmarks.recipes.wrappers import loss_of
from benchmarks.zoo.scoring import RealOutcome
from torch import nn
from torch.utils._pytree import tree_map_only


def _trainer(model: nn.Module, batch: Any, precision: str, callbacks: list[Any], out: str, use_cpu: bool = True) -> Any:
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainingArguments

    for name in ("transformers", "accelerate", "castwise"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class OneBatch(Trainer):  # type: ignore[misc]
        def get_train_dataloader(self) -> DataLoader[Any]:
            return DataLoader([batch], batch_size=None)

        def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
            return loss_of(model, inputs)

    args = TrainingArguments(
        output_dir=out,
        use_cpu=use_cpu,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        remove_unused_columns=False,
        seed=0,
    )
    trainer = OneBatch(model=model, args=args, train_dataset=[batch], callbacks=callbacks)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for chatter in (PrinterCallback, ProgressCallback):  # the benchmark prints tables, not fit logs
        trainer.remove_callback(chatter)
    return trainer


def fit(model: nn.Module, batch: Any, precision: str, with_callback: bool, use_cpu: bool = True) -> FitResult:
    """One ``trainer.train()`` step; with the callback, its report as the audit's outcome."""
    from castwise.integrations.transformers import CastwiseAuditError, CastwiseTrainerCallback

    callback = CastwiseTrainerCallback(mode="both") if with_callback else None
    start = time.perf_counter()
    error: BaseException | None = None
    with tempfile.TemporaryDirectory() as out:
        try:
            _trainer(model, batch, precision, [callback] if callback else [], out, use_cpu).train()
        except (CastwiseAuditError, Exception) as exc:
            error = exc
    audit = None
    if callback is not None:
        from castwise.integrations.transformers import CastwiseAuditError

        audit = callback_outcome(callback, error, time.perf_counter() - start, CastwiseAuditError, "training")
    weights = None if error is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return FitResult(_outcome(error), weights, audit)


def evaluate_eval(model: nn.Module, batch: Any, precision: str, device: str = "cpu") -> RealOutcome:
    """The eval truth: the model's forward in eval mode under no_grad and the Trainer's autocast
    (Accelerate's autocast around the prepared model's forward)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model.eval()
    if device != "cpu":
        model = model.to(device)
        batch = tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
    try:
        with torch.no_grad(), torch.autocast(device, dtype=dtype):
            loss_of(model, batch)
    except Exception as exc:
        return _outcome(exc)
    return RealOutcome("ok")
