"""CW122 on a Hugging Face model whose config names bf16: the dtype came from the config's
torch_dtype, for every layer at once; the fix is the build's dtype or a *-true policy, each
checked here by a re-audit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import castwise
from castwise.cli.target import load_target

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def _config(tmp_path: Path, dtype: str) -> str:
    folder = tmp_path / dtype
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": dtype}), encoding="utf-8")
    return str(folder / "config.json")


def _cw122(target: str, policy: str) -> list[castwise.Finding]:
    model, inputs = load_target(target, seq_len=8)
    report = castwise.audit(model, inputs, policy=policy, mode="eval")
    return [f for f in report.findings if f.code == "CW122"]


def test_a_bf16_config_under_bf16_mixed_names_the_config_and_the_fixes_that_match(tmp_path: Path) -> None:
    (f,) = _cw122(_config(tmp_path, "bfloat16"), "bf16-mixed")
    assert '"torch_dtype": "bfloat16"' in f.message and "config" in f.message
    assert "probably cast by hand" not in (f.fix or "") and "keep[" not in (f.fix or "")
    assert "dtype=torch.float32" in (f.fix or "") and "`bf16-true`" in (f.fix or "")
    assert f.module == ""  # every layer's weights, not the first one's module


@pytest.mark.parametrize(("dtype", "policy"), [("bfloat16", "bf16-true"), ("float32", "bf16-mixed")])
def test_the_offered_fixes_clear_it(tmp_path: Path, dtype: str, policy: str) -> None:
    assert _cw122(_config(tmp_path, dtype), policy) == []


def test_a_tensor_cast_by_hand_in_a_float32_build_keeps_the_module_fix(tmp_path: Path) -> None:
    import torch

    model, inputs = load_target(_config(tmp_path, "float32"), seq_len=8)
    model.model.norm.to(torch.bfloat16)  # by hand: not the config's dtype
    (f,) = [x for x in castwise.audit(model, inputs, policy="bf16-mixed", mode="eval").findings if x.code == "CW122"]
    assert "probably cast by hand" in (f.fix or "") and "keep[model.norm]=bf16" in (f.fix or "")
