"""The engines' precisions as the engines run them (castwise.policy.presets.ENGINES), checked against
the real engines: transformers' from_pretrained(dtype=...) from a local save, FSDP2's fully_shard on
a one-rank gloo group."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import castwise
from castwise.policy import Policy


def _llama(layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    return LlamaForCausalLM(cfg)


def _resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetModel

    return ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1], num_channels=3))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    return T5ForConditionalGeneration(cfg)


def _dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {name: t.dtype for name, t in tensors if t.is_floating_point()}


@pytest.mark.parametrize(
    ("build", "dtype", "text"),
    [
        (_llama, torch.bfloat16, "hf:bfloat16"),  # rotary inv_freq: non-persistent, float32
        (_resnet, torch.bfloat16, "hf:bfloat16"),  # BatchNorm running stats: persistent, cast
        (_t5, torch.float16, "hf:float16"),  # _keep_in_fp32_modules = ["wo"] under float16
    ],
    ids=["llama", "resnet", "t5"],
)
def test_hf_dtype_stores_what_from_pretrained_loads(build: Any, dtype: torch.dtype, text: str) -> None:
    model = build()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        loaded = type(model).from_pretrained(tmp, dtype=dtype)
    twin = copy.deepcopy(model)
    castwise.apply(twin, text)
    assert _dtypes(twin) == _dtypes(loaded)


def test_hf_bfloat16_compares_a_clean_llama_within_tolerance() -> None:
    model = _llama()
    # far positions: a bf16 inv_freq turns them into another phase (what the old hf:bfloat16 did)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(4000, 4016)[None]}
    clean = castwise.compare(model, batch, policy="hf:bfloat16")
    assert [f.code for f in clean.findings] == []
    # the same Llama with its inv_freq cast (pure_bf16, the old reading): the rotary's error is real
    cast = castwise.compare(model, batch, policy="pure_bf16")
    assert [f.module for f in cast.findings if f.code == "CW320"] == ["model.rotary_emb"]
    assert clean.summary["loss_err"] < cast.summary["loss_err"]
    # the audit reads the same policy: the float32 inv_freq is what the policy means, not a stray dtype
    assert castwise.audit(model, batch, policy="hf:bfloat16", device="cpu").findings == []


@pytest.mark.parametrize(("text", "inputs"), [("fsdp2:bf16", torch.bfloat16), ("deepspeed:bf16", None)])
def test_engines_cast_weights_without_autocast(text: str, inputs: torch.dtype | None) -> None:
    policy = Policy.parse(text)
    assert not policy.is_mixed  # no autocast: cross-entropy runs on the 16-bit logits
    assert (policy.param_dtype, policy.compute_dtype) == (torch.bfloat16, torch.bfloat16)
    assert (policy.input_dtype, policy.norms) == (inputs, None)
    assert policy.keep_buffers  # buffers as the model made them: neither engine casts one
    assert policy.master_weights and not policy.keep_in_fp32
    assert Policy.parse(str(policy)) == policy
    # the audit, compare and tune read one model: the same parse
    assert str(policy) == text.replace(":bf16", "-bf16")


@pytest.fixture
def one_rank() -> Iterator[None]:
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.head = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 50)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.norm(self.a(x)).relu()), y)


def _sharded(model: nn.Module, units: list[nn.Module]) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for unit in units:
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


@pytest.mark.usefixtures("one_rank")
def test_fsdp2_loss_is_real_fully_shards() -> None:
    torch.manual_seed(0)
    llama = _llama()
    ids = torch.randint(0, 64, (2, 16))
    twin = copy.deepcopy(llama)
    real = _sharded(twin, list(twin.model.layers))(input_ids=ids, labels=ids).loss.item()
    batch = {"input_ids": ids, "labels": ids}
    assert castwise.compare(llama, batch, policy="fsdp2:bf16").summary["loss_policy"] == real
    # the old reading (autocast, torchtitan's keys): another program, another loss
    assert castwise.compare(llama, batch, policy="bf16-mixed,output=bf16").summary["loss_policy"] != real

    clf = _Classifier()
    x, y = torch.randn(8, 16) * 3, torch.randint(0, 50, (8,))
    twin = copy.deepcopy(clf)
    real = _sharded(twin, [])(x, y)  # float inputs cast by cast_forward_inputs; cross-entropy in bf16
    assert real.dtype == torch.bfloat16
    assert castwise.compare(clf, (x, y), policy="fsdp2:bf16").summary["loss_policy"] == real.item()


class _Tables(nn.Module):
    """A model that makes its rotary table in bf16 itself (nanochat) beside a float32 one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("cos16", torch.rand(16).bfloat16(), persistent=False)
        self.register_buffer("cos32", torch.rand(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.cos16.dtype == torch.bfloat16 and self.cos32.dtype == torch.float32, "buffers cast"
        return self.lin(x) * self.cos16 + self.cos32.to(x.dtype)


@pytest.mark.usefixtures("one_rank")
def test_fsdp2_leaves_every_buffer_as_the_model_made_it() -> None:
    """Real fully_shard casts parameters only: a bf16 buffer stays bf16 and an f32 one f32; the
    fsdp2: preset does the same (an f32 upcast of the bf16 table was castwise's own error)."""
    torch.manual_seed(0)
    model, x = _Tables(), torch.randn(4, 16)
    real = _sharded(copy.deepcopy(model), [])(x)
    assert real.dtype == torch.bfloat16
    report = castwise.audit(model, (x,), policy="fsdp2:bf16", device="cpu")
    assert report.errors == [], report.errors
    assert castwise.compare(model, (x,), policy="fsdp2:bf16").summary is not None
