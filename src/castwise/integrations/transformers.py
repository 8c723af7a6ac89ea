"""``CastwiseTrainerCallback``: the Lightning callback's behaviour for the Hugging Face Trainer.

On ``on_train_begin`` (before the first step) it audits ``model(**batch)`` on fake tensors,
for a batch from the train dataloader, under the Trainer's precision (``bf16`` ->
``bf16-mixed``, ``fp16`` -> ``16-mixed``, else the model as it is) in train and eval mode.
An error finding raises ``CastwiseAuditError`` (the Trainer stops); ``fix=True`` applies the
suggested policy to the model and training goes on. An error that is not about dtypes is left
to the training step itself to raise.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from castwise.errors import CastwiseError
from castwise.integrations._steps import CastwiseAuditError, GatedCallback, audit_or_skip, random_streams_kept

__all__ = ["CastwiseAuditError", "CastwiseTrainerCallback", "trainer_precision"]


def trainer_precision(args: Any) -> str | None:
    """The castwise policy string for TrainingArguments' precision flags."""
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    if getattr(args, "fp16", False):
        return "16-mixed"
    return None


def _audited(mode: str, precision: str | None) -> str:
    modes = {"both": "train and eval mode", "train": "train mode", "eval": "eval mode"}[mode]
    under = f"under {precision}" if precision else "as it is (no bf16/fp16 flag)"
    return f"the model's forward in {modes} {under}"


class CastwiseTrainerCallback(GatedCallback, TrainerCallback):  # type: ignore[misc]
    """Audit the model at train begin; stop on an error, or ``fix=True`` to apply the suggested
    policy and continue. ``watch``: also watch every training step's loss (``castwise.watch``
    on the model's forward); the first non-finite one is replayed under
    ``castwise.locate_nonfinite`` and raises ``NonfiniteError`` (or ``"warn"``, or a callable)."""

    def __init__(self, *, fix: bool = False, mode: str = "both", watch: Any = False) -> None:
        super().__init__(fix=fix, mode=mode)
        self.watch = watch
        self._watch: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from castwise.auditor import audit

        model = kwargs.get("model")
        loader = kwargs.get("train_dataloader")
        if model is None or loader is None:
            raise CastwiseError("CastwiseTrainerCallback needs the Trainer's model and train dataloader")
        # the run goes on as it would without the callback: the batch drawn here and the audit
        # leave every random stream (the sampler's included) as it was
        with random_streams_kept(), random_streams_kept(loader):
            batch = next(iter(loader))
            inputs = dict(batch) if isinstance(batch, dict) or hasattr(batch, "keys") else batch
            training = model.training
            try:
                report = audit_or_skip(
                    lambda: audit(
                        model, inputs, policy=trainer_precision(args), device=args.device.type, mode=self.mode
                    ),
                    f"{type(model).__name__} (CastwiseTrainerCallback)",
                    log=bool(getattr(state, "is_world_process_zero", True)),
                )
            finally:
                model.train(training)
        if report is not None:
            self._gate.act(
                report,
                model,
                where="training",
                audited=_audited(self.mode, trainer_precision(args)),
                log=bool(getattr(state, "is_world_process_zero", True)),
            )
        if self.watch:
            from castwise.numerics.watch import watch

            self._watch = watch(model, on_nonfinite="raise" if self.watch is True else self.watch).__enter__()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._gate.restore()
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None
