"""CastwiseTrainerCallback under a real transformers.Trainer (tiny Llama, built from a config)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from castwise.integrations.transformers import CastwiseAuditError, CastwiseTrainerCallback, trainer_precision


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i, i + 8) % 64
        return {"input_ids": ids, "labels": ids.clone()}


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def _trainer(model: LlamaForCausalLM, callback: CastwiseTrainerCallback, tmp_path: object, **kw: Any) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        **kw,
    )
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])


def test_precision_mapping() -> None:
    class Args:
        bf16 = True
        fp16 = False

    assert trainer_precision(Args()) == "bf16-mixed"
    Args.bf16, Args.fp16 = False, True
    assert trainer_precision(Args()) == "16-mixed"
    Args.fp16 = False
    assert trainer_precision(Args()) is None


def test_clean_model_trains_and_says_so_in_one_log_line(tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="castwise")
    callback = CastwiseTrainerCallback()
    _trainer(_model(), callback, tmp_path, bf16=True).train()
    assert callback.report is not None and callback.report.ok
    lines = [r.getMessage() for r in caplog.records if r.name == "castwise"]
    assert lines == ["castwise: audited the model's forward in train and eval mode under bf16-mixed: no dtype errors"]


def test_half_cast_head_stops_training_before_the_first_step(tmp_path: object) -> None:
    model = _model()
    model.lm_head.to(torch.bfloat16)  # one layer cast by hand, no autocast to reconcile it
    callback = CastwiseTrainerCallback()
    before = model.model.embed_tokens.weight.detach().clone()
    with pytest.raises(CastwiseAuditError, match="lm_head") as info:
        _trainer(model, callback, tmp_path).train()
    assert torch.equal(model.model.embed_tokens.weight, before)  # no step ran
    # the way on names this callback, not the Lightning one
    assert "(CastwiseTrainerCallback(fix=True) applies it" in str(info.value)
    assert "CastwiseCallback(" not in str(info.value)


def test_fix_applies_the_policy_and_says_so_in_one_log_line(tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="castwise")
    model = _model()
    model.lm_head.to(torch.bfloat16)
    callback = CastwiseTrainerCallback(fix=True)
    _trainer(model, callback, tmp_path).train()
    assert callback.applied is not None and model.lm_head.weight.dtype == torch.float32
    lines = [r.getMessage() for r in caplog.records if r.name == "castwise"]
    assert lines == [f"castwise: applied suggested policy {callback.applied.policy} (fixes CW113 at lm_head)"]


def test_the_callback_leaves_the_run_as_it_would_be_without_it(tmp_path: Any) -> None:
    # a shuffled loader and dropout: a callback that draws a batch or random numbers changes
    # which batches the run sees and its masks; with it, the weights after the steps are the same
    def run(with_callback: bool) -> dict[str, torch.Tensor]:
        model = _model()
        model.config.attention_dropout = 0.5
        callbacks = [CastwiseTrainerCallback()] if with_callback else []
        args = TrainingArguments(
            output_dir=str(tmp_path / str(with_callback)),
            use_cpu=True,
            max_steps=2,
            per_device_train_batch_size=2,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=3,
        )
        Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks).train()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    without, with_it = run(False), run(True)
    assert without.keys() == with_it.keys()
    assert all(torch.equal(without[k], with_it[k]) for k in without)
