"""Modules changed while the model runs, under fake tensors as under real ones.

transformers' SwitchTransformers router re-casts its classifier on every call
(``self.classifier = self.classifier.to(self.dtype)``). On real parameters ``nn.Module._apply``
sets ``param.data``; on fake ones torch swaps the tensor objects, which refused (``_apply():
Couldn't swap Linear.weight``) and became a false CW130. Truth is the real run on CPU.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import castwise


class _Router(nn.Module):
    """A router kept in float32 however the model runs (SwitchTransformers' own pattern)."""

    def __init__(self, *, keep_output: bool = False) -> None:
        super().__init__()
        self.dtype = torch.float32
        self.classifier = nn.Linear(16, 4, bias=False)
        self.keep_output = keep_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(self.dtype)
        probs = self.classifier(x.to(self.dtype)).softmax(-1)
        return probs if self.keep_output else probs.to(x.dtype)


class _Lazy(nn.Module):
    """A table built on first use and re-cast to the activations' dtype on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.register_buffer("table", torch.linspace(0, 1, 4), persistent=False)
        self.to(x.dtype)
        return x * self.table.to(x.dtype).repeat(4)


class _Model(nn.Module):
    def __init__(self, *, planted: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.router = _Router()
        self.lazy = _Lazy()
        self.out = nn.Linear(4, 8)
        self.planted = planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gates = self.router(h)
        if self.planted:  # the bug: float32 gates into a matmul with the bf16 weight
            gates = gates.float()
        return self.out(gates) + self.lazy(h).sum(-1, keepdim=True)


def _codes(model: nn.Module, x: torch.Tensor, policy: str) -> list[str]:
    return [f.code for f in castwise.audit(model, x, policy=policy).findings if f.severity == "error"]


def test_submodule_recast_in_forward_is_no_error_on_fake_tensors() -> None:
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(4, 8)
    real = copy.deepcopy(model)  # truth: the real mixed step trains on CPU
    with torch.autocast("cpu", torch.bfloat16):
        y = real(x)
    y.float().sum().backward()
    weight = model.router.classifier.weight
    assert _codes(model, x, "bf16-mixed") == []
    assert model.router.classifier.weight is weight and weight.dtype == torch.float32  # the user's model untouched
    assert torch.utils.swap_tensors.__module__ == "torch.utils"  # torch's own swap is back


def test_recast_to_a_new_dtype_after_the_module_ran_is_no_error() -> None:
    """bf16-true casts the model to bf16; the router re-casts its classifier to float32 after the
    classifier already ran once in bf16: as in the real run, both uses reach one gradient."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first = self.lin(x)
            self.lin = self.lin.to(torch.float32)
            return first.float() + self.lin(x.float())

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(4, 16)
    real = copy.deepcopy(model).to(torch.bfloat16)
    real(x.to(torch.bfloat16)).sum().backward()  # truth: it runs
    report = castwise.audit(model, x, policy="bf16-true", mode="train")
    assert "CW130" not in [f.code for f in report.findings]


def test_a_planted_bug_next_to_the_recast_is_still_found() -> None:
    torch.manual_seed(0)
    model, x = _Model(planted=True), torch.randn(4, 8)
    real = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(RuntimeError):  # truth: the real bf16-true run fails at `out`
        real(x.to(torch.bfloat16))
    codes = _codes(model, x, "bf16-true")
    assert codes and "CW130" not in codes


def test_switch_transformers_router_recast_is_no_false_cw130() -> None:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        num_experts=2,
        expert_capacity=8,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = SwitchTransformersForConditionalGeneration(config)
    inputs = {"input_ids": torch.randint(1, 64, (2, 8)), "labels": torch.randint(1, 64, (2, 6))}
    real = copy.deepcopy(model)
    with torch.autocast("cpu", torch.bfloat16):
        loss = real(**inputs).loss
    loss.backward()  # truth: the real mixed step trains on CPU
    report = castwise.audit(model, inputs, policy="bf16-mixed")
    assert [f for f in report.findings if f.code == "CW130"] == []
    assert not report.errors
    # the whole model was checked: its experts' f"expert_{idx[0]}" lookup formats the fake index's value
    assert [f.code for f in report.findings if f.code == "CW902"] == []
    assert torch.Tensor.__format__.__module__ == "torch._tensor"  # torch's own formatting is back


class _CheckpointedLayer(nn.Module):
    """A decoder layer run under ``checkpoint(use_reentrant=True)`` in training, its keyword
    arguments bound with ``functools.partial`` (as Hugging Face does for the reentrant mode)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fn = functools.partial(self.layer, **kwargs)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)


def test_transformers_takes_its_eager_path_under_fake_tensors_as_under_real_ones() -> None:
    from transformers import BartConfig, BartForConditionalGeneration
    from transformers.utils.import_utils import is_tracing

    seen: list[bool] = []

    class AsksIfTraced(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(is_tracing(x))
            return x * 2

    castwise.audit(AsksIfTraced(), torch.randn(2, 4), mode="eval")
    assert seen == [False]  # as the real run answers: no trace, no compile, no export

    # BART's decoder under reentrant checkpointing: the recompute in backward runs with the
    # cache grown by the first pass; SDPA's is_causal (the eager path) takes it, and the real
    # run trains. A mask built for the first pass (the compile path) refused it: a false CW130.
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    model = BartForConditionalGeneration(config)
    layers = model.model.decoder.layers
    layers[0] = _CheckpointedLayer(layers[0])
    inputs = {"input_ids": torch.randint(0, 64, (2, 8)), "decoder_input_ids": torch.randint(0, 64, (2, 5))}
    real = copy.deepcopy(model).train()
    real(**inputs).logits.float().sum().backward()  # truth: the real run trains
    for device in ("cpu", "cuda"):
        report = castwise.audit(model, inputs, mode="train", device=device)
        assert not report.errors, str(report)
