"""forecast(layerwise=True): a transformers model's blocks one at a time give the same sites as
the whole model, from memory, from a safetensors file on a meta-device model, or initialised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from castwise.errors import CastwiseError
from castwise.numerics.forecast import forecast
from castwise.numerics.layerwise import blocks_of

DOWN = "model.layers.1.mlp.down_proj"


def _config(**more: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **more,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def _llama(planted: bool = True, **more: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(**more))
    if planted:
        with torch.no_grad():  # layer 1's MLP output passes 65504 (as T5's wo does in checkpoints)
            up: Any = model.get_submodule("model.layers.1.mlp.up_proj").weight
            down: Any = model.get_submodule(DOWN).weight
            up.mul_(1e3)
            down.mul_(3e4)
    ids = torch.randint(0, 128, (2, 12))
    return model, {"input_ids": ids, "labels": ids}


def _sites(report: Any) -> set[tuple[str, str]]:
    return {(f.module, dict(f.details)["phase"]) for f in report.findings if f.code == "CW310"}


def _ranges(report: Any) -> dict[tuple[str, str], float]:
    modules = report.summary["numerics"]["modules"]
    return {(m, ph): e["absmax"] for m, phases in modules.items() for ph, e in phases.items()}


def test_blocks_are_the_decoder_layers() -> None:
    model, _ = _llama(planted=False)
    assert [n for n, _ in blocks_of(model)] == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_layerwise_finds_the_same_sites_and_ranges_as_the_whole_model() -> None:
    model, inputs = _llama()
    whole = forecast(model, inputs, target="f16")
    layered = forecast(model, inputs, target="f16", layerwise=True)
    assert (DOWN, "forward") in _sites(whole)
    assert _sites(layered) == _sites(whole)
    a, b = _ranges(whole), _ranges(layered)
    assert set(a) == set(b)
    # every module's forward and backward magnitudes: the same ops on the same inputs
    assert all(b[k] == pytest.approx(v, rel=1e-4, abs=1e-6) for k, v in a.items())
    how = layered.summary["numerics"]["layerwise"]
    assert how["blocks"] == 3 and "in memory" in how["materialised"]
    assert "layerwise" in layered.title and "layerwise" not in whole.summary["numerics"]


def test_dropout_draws_the_same_masks_in_the_recomputation() -> None:
    model, inputs = _llama(planted=False, attention_dropout=0.3)
    torch.manual_seed(1)
    whole = _ranges(forecast(model, inputs, target="f16"))
    torch.manual_seed(1)
    layered = _ranges(forecast(model, inputs, target="f16", layerwise=True))
    assert layered == pytest.approx(whole, rel=1e-4, abs=1e-6)


def test_meta_model_runs_layerwise_from_a_safetensors_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model, inputs = _llama()
    whole = forecast(model, inputs, target="f16")
    file = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(file))
    with torch.device("meta"):
        meta = LlamaForCausalLM(_config())
    report = forecast(meta, inputs, target="f16", weights=file)  # meta: layerwise on its own
    assert _sites(report) == _sites(whole)
    assert _ranges(report) == pytest.approx(_ranges(whole), rel=1e-4, abs=1e-6)
    how = report.summary["numerics"]["layerwise"]
    assert "3 blocks one at a time" in how["materialised"] and "model.safetensors" in how["materialised"]
    # the caller's model is left on the meta device, as it came
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_meta_model_without_weights_is_initialised_the_same_way_each_run() -> None:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(_config())
    ids = torch.randint(0, 128, (1, 8))
    first = forecast(meta, {"input_ids": ids, "labels": ids}, target="f16")
    again = forecast(meta, {"input_ids": ids, "labels": ids}, target="f16")
    assert _ranges(first) == _ranges(again) and _ranges(first)
    assert "deterministic initialisation" in first.summary["numerics"]["layerwise"]["materialised"]


def test_layerwise_needs_repeated_blocks_and_says_so() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(CastwiseError, match="no repeated blocks"):
        forecast(model, (torch.randn(2, 4),), layerwise=True)


def test_a_wrong_weights_file_is_refused(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(_config())
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(CastwiseError, match="safetensors"):
        forecast(meta, {"input_ids": ids}, weights=tmp_path / "model.bin")


def test_a_policy_on_a_meta_model_is_refused() -> None:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(_config())
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(CastwiseError, match="meta device is not supported"):
        forecast(meta, {"input_ids": ids}, policy="bf16-mixed")
