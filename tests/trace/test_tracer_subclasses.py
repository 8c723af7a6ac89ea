"""Tensor subclasses under the tracer: followed by what their own code runs, not by their class.

torchao's float8 training (``convert_to_float8_training``, emulated on CPU) runs its matmuls on
``Float8TrainingTensor`` operands whose dtype is the high-precision one they stand for (a
float32 weight next to a bf16 gradient in backward); the subclass unwraps them and multiplies
float8 data upcast to float32. Truth is the real run on CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchao.float8 as torchao_float8
from torch import nn

import castwise


def _float8(model: nn.Module, *, fsdp_weights: bool = False) -> nn.Module:
    config = torchao_float8.Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=fsdp_weights)
    # the output head stays a plain Linear, as torchao's recipes keep it
    return torchao_float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: n != "lm_head")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return _float8(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))


def _errors(model: nn.Module, inputs: object, policy: str, *, fake: bool) -> list[tuple[str, str]]:
    report = castwise.audit(model, inputs, policy=policy, fake=fake)
    return [(f.code, f.message) for f in report.findings if f.severity == "error"]


def _real_mixed_step(model: nn.Module, inputs: dict[str, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The real training step under bf16 autocast on CPU (raises where the recipe is broken)."""
    model = copy.deepcopy(model)
    with torch.autocast("cpu", torch.bfloat16):
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    loss = out.loss if hasattr(out, "loss") else out.float().sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_float8_mlp_under_bf16_mixed_has_no_error(fake: bool) -> None:
    model, x = _mlp(), torch.randn(16, 32)
    assert type(model[0]).__name__ == "Float8Linear"
    _real_mixed_step(model, x)  # the real step trains
    assert _errors(model, x, "bf16-mixed", fake=fake) == []


@pytest.mark.parametrize("fsdp_weights", [False, True], ids=["plain-weight", "float8-cast-weight"])
def test_float8_llama_under_bf16_mixed_has_no_error(fsdp_weights: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = _float8(LlamaForCausalLM(config), fsdp_weights=fsdp_weights)
    weight = model.model.layers[0].mlp.up_proj.weight
    if fsdp_weights:  # the weight itself a subclass (WeightWithDynamicFloat8CastTensor)
        assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    ids = torch.randint(0, 128, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    _real_mixed_step(model, inputs)
    assert _errors(model, inputs, "bf16-mixed", fake=True) == []
    assert _errors(model, inputs, "bf16-mixed", fake=False) == []


class _Planted(nn.Module):
    """Float8 layers around a float32 mixing matrix kept as a plain attribute: under bf16-true the
    bf16 activations meet it in a matmul, which the real kernel refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 16)
        self.mix = torch.randn(64, 64)  # the bug: not a buffer, so nothing casts it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        return self.down(h @ self.mix)


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_float8_model_with_a_planted_bug_is_still_found(fake: bool) -> None:
    torch.manual_seed(0)
    model, x = _float8(_Planted()), torch.randn(16, 32)
    real = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):  # truth: the real bf16-true run fails
        real(x.to(torch.bfloat16))
    errors = _errors(model, x, "bf16-true", fake=fake)
    assert errors, "the planted float32 matmul operand was not found"
    assert all(code != "CW130" for code, _m in errors)


class _Tp(nn.Module):
    """A tensor-parallel MLP (DTensor weights); ``planted``: its bf16 output (under autocast)
    written into a float32 table by index, which the real kernel refuses."""

    def __init__(self, *, planted: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 16)
        self.planted = planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(torch.relu(self.up(x)))
        if not self.planted:
            return out
        table = torch.zeros(out.shape, dtype=torch.float32)
        table[torch.arange(out.shape[0])] = out
        return table


@pytest.mark.parametrize("planted", [False, True], ids=["clean", "planted"])
def test_tensor_parallel_dtensor_model_is_followed_on_fake_tensors(planted: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = _Tp(planted=planted)
        parallelize_module(model, init_device_mesh("cpu", (2,)), {"up": ColwiseParallel(), "down": RowwiseParallel()})
        assert isinstance(model.up.weight, DTensor)
        x = torch.randn(8, 32)
        if planted:
            with pytest.raises(RuntimeError, match="dtypes match"):  # truth: the real mixed step fails
                _real_mixed_step(model, x)
            codes = [code for code, _m in _errors(model, x, "bf16-mixed", fake=True)]
            assert codes and "CW130" not in codes
        else:
            _real_mixed_step(model, x)
            assert _errors(model, x, "bf16-mixed", fake=True) == []
            assert _errors(model, x, "bf16-mixed", fake=False) == []
    finally:
        dist.destroy_process_group()
