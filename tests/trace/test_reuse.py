"""Repeated blocks traced once (trace/reuse.py): a block keyed like one already traced reuses its
record, renamed; the report is the one a full trace gives, and a fault planted in one block
makes that block trace for itself and is found where it is, with the same origin."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchvision
import transformers
from torch import nn

from castwise.auditor.session import run_audit
from castwise.policy import Policy
from castwise.report import Report
from castwise.trace import reuse


def _llama(layers: int = 4) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))


def _audit(model: nn.Module, inputs: Any, policy: str | None, device: str) -> tuple[Report, list[Any]]:
    return run_audit(model, inputs, None if policy is None else Policy.parse(policy), device, "both", True)


def _both(model: nn.Module, inputs: Any, policy: str | None = "bf16-mixed", device: str = "cuda") -> tuple[Any, Any]:
    with_reuse, runs = _audit(model, inputs, policy, device)
    with reuse.disabled():
        without, _ = _audit(model, inputs, policy, device)
    return (with_reuse, runs), without


def _reused(runs: list[Any]) -> dict[str, str]:
    found = [o for o in runs[0].producer.observers if isinstance(o, reuse.BlockReuse)]
    return found[0].reused if found else {}


def test_identical_decoder_layers_reuse_the_first_layers_record() -> None:
    (report, runs), without = _both(_llama(4), _ids())
    # train: the last layer traces for itself too (its backward runs first, and is the record of
    # the reused layers' backward); eval: only the first
    assert _reused(runs) == {f"model.layers.{i}": "model.layers.0" for i in (1, 2)}
    assert _reused(runs[1:]) == {f"model.layers.{i}": "model.layers.0" for i in (1, 2, 3)}
    assert report.to_dict() == without.to_dict()
    # the spliced records stand for every op, forward and backward
    assert report.summary["ops_traced"] == without.summary["ops_traced"]
    assert len(runs[0].trace.ops) == report.summary["ops_traced"]["train"]


def test_switched_off_every_block_traces_for_itself() -> None:
    with reuse.disabled():
        _report, runs = _audit(_llama(3), _ids(), "bf16-mixed", "cuda")
    assert _reused(runs) == {}


def _t5() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_decoder_layers=3, num_heads=4
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg)


def _mixtral() -> nn.Module:
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False), nn.Linear(32, 8))


def _every_layer_f64(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.mlp.down_proj.double()
    return model


def _checkpointed(reentrant: bool) -> nn.Module:
    model = _llama(3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


_CASES: dict[str, tuple[Any, Any, str | None, str]] = {
    "llama-cuda": (lambda: _llama(4), _ids, "bf16-mixed", "cuda"),
    "llama-cpu-f16": (lambda: _llama(3), _ids, "16-mixed", "cpu"),
    "llama-fault-in-every-layer": (lambda: _every_layer_f64(_llama(3)), _ids, "bf16-mixed", "cuda"),
    "llama-checkpoint": (lambda: _checkpointed(False), _ids, "bf16-mixed", "cuda"),
    "llama-checkpoint-reentrant": (lambda: _checkpointed(True), _ids, "bf16-mixed", "cuda"),
    "t5": (_t5, lambda: {"input_ids": _ids(), "decoder_input_ids": _ids()}, "bf16-mixed", "cuda"),
    "bert": (_bert, _ids, "bf16-mixed", "cuda"),
    "mixtral": (_mixtral, _ids, "bf16-mixed", "cuda"),
    "transformer-encoder": (_encoder, lambda: torch.randn(2, 5, 32), "16-mixed", "cuda"),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=8), lambda: torch.randn(1, 3, 32, 32), "bf16", "cpu"),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_the_report_is_the_same_with_and_without_reuse(case: str) -> None:
    build, inputs, policy, device = _CASES[case]
    (report, _runs), without = _both(build(), inputs(), policy, device)
    assert report.to_dict() == without.to_dict()


def test_a_fault_in_every_layer_is_named_in_each_layer() -> None:
    (report, runs), without = _both(_every_layer_f64(_llama(3)), _ids())
    assert _reused(runs)  # the layers alike in their fault still share a record
    details = dict(next(f for f in report.findings if f.level == "error").details)
    assert details["culprit_modules"] == [f"model.layers.{i}.mlp.down_proj" for i in range(3)]
    assert report.to_dict() == without.to_dict()


def _f64_block(model: nn.Module) -> str:
    model.model.layers[17].mlp.down_proj.double()  # type: ignore[index,union-attr]
    return "model.layers.17.mlp.down_proj"


def _grad_to_bf16(grad: torch.Tensor) -> torch.Tensor:
    return grad.to(torch.bfloat16)


def _hooked_block(model: nn.Module) -> str:
    # found in backward: the hook's block traces for itself there too
    model.model.layers[17].self_attn.o_proj.weight.register_hook(_grad_to_bf16)  # type: ignore[index,union-attr]
    return "model.layers.17.self_attn.o_proj"


@pytest.mark.parametrize("plant", [_f64_block, _hooked_block])
def test_a_fault_in_block_17_of_32_is_found_there_with_the_same_origin(plant: Any) -> None:
    model = _llama(32)
    where = plant(model)
    (report, runs), without = _both(model, _ids())
    reused = _reused(runs)
    assert "model.layers.17" not in reused  # the planted block traced for itself
    assert "model.layers.18" in reused and "model.layers.16" in reused
    errors = [f for f in report.findings if f.level == "error"]
    assert errors, [f.code for f in report.findings]
    first, plain = errors[0], next(f for f in without.findings if f.level == "error")
    assert (first.code, first.module, first.origin) == (plain.code, plain.module, plain.origin)
    assert any(m and m.startswith(where) for m in (first.module, first.origin and first.origin.module))
    assert [f.to_dict() for f in report.findings] == [f.to_dict() for f in without.findings]
    assert report.summary["modules"] == without.summary["modules"]
