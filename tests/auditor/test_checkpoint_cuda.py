"""Gradient checkpointing audited on the simulated CUDA GPU: the recompute re-enters the forward's
autocast through ``torch.amp.autocast("cuda")`` and runs the same dtypes, as on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import castwise

MODES = [True, False]


@pytest.mark.parametrize("use_reentrant", MODES, ids=["reentrant", "non-reentrant"])
def test_checkpoint_recomputes_in_the_forwards_autocast_dtype(use_reentrant: bool) -> None:
    calls: list[tuple[bool, torch.dtype]] = []

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def block(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            # the forward, then the recompute (which stops early, after relu saves its output)
            calls.append((torch.is_autocast_enabled("cuda"), h.dtype))
            return torch.relu(h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(checkpoint.checkpoint(self.block, x, use_reentrant=use_reentrant)).float().sum()

    x = torch.randn(2, 8, requires_grad=True)
    report = castwise.audit(Checkpointed(), x, policy="bf16-mixed", device="cuda", mode="train")
    assert report.ok, str(report)
    assert calls == [(True, torch.bfloat16)] * 2


def _tiny_llama(use_reentrant: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    return model


@pytest.mark.parametrize("use_reentrant", MODES, ids=["reentrant", "non-reentrant"])
def test_a_gradient_checkpointed_llama_is_clean_on_simulated_cuda(use_reentrant: bool) -> None:
    ids = torch.randint(0, 64, (2, 8))
    model = _tiny_llama(use_reentrant)
    report = castwise.audit(model, {"input_ids": ids, "labels": ids}, policy="bf16-mixed", device="cuda", mode="train")
    assert report.ok, str(report)
    assert not report.findings, str(report)
