"""Gradient checkpointing audited on the simulated CUDA GPU: the recompute re-enters the forward's
autocast through ``torch.amp.autocast("cuda")`` and runs the same dtypes, as on a GPU."""

from __future__ import annotations

import functools
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


def test_a_block_given_its_tensors_by_keyword_recomputes_under_the_gpus_autocast() -> None:
    # non-reentrant checkpoint reads the device whose autocast it restores off the positional
    # tensors; with none (diffusers' up blocks get theirs by keyword) it takes its default device type, which a
    # CPU run on this machine cached as "cpu": a GPU machine answers "cuda"
    calls: list[bool] = []

    class ByKeyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def block(self, *, h: torch.Tensor) -> torch.Tensor:
            calls.append(torch.is_autocast_enabled(h.device.type))
            return torch.relu(self.b(h))  # bf16 h into an f32 layer: refused without autocast

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                h = self.a(x)
                fn = functools.partial(self.block, h=h)
                return checkpoint.checkpoint(fn, use_reentrant=False).float().sum()

    cached = checkpoint.DefaultDeviceType._default_device_type
    try:
        checkpoint.DefaultDeviceType.get_device_type()  # a CPU run asked first: "cpu" cached
        report = castwise.audit(ByKeyword(), torch.randn(2, 8), device="cuda", mode="train")
    finally:
        checkpoint.DefaultDeviceType._default_device_type = cached
    assert report.ok, str(report)
    assert calls == [True, True]  # the forward and the recompute, both under the GPU's autocast
