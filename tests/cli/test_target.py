"""`castwise audit TARGET`: builder functions, transformers configs on the meta device, and the
messages for every target that cannot be loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from castwise.cli import main
from castwise.cli.target import load_target
from castwise.errors import TargetError

FIXTURES = Path(__file__).parent.parent / "rules" / "fixtures"
SRC = Path(__file__).parent.parent.parent / "src"


def _cli(*args: str, cwd: Path, safe_path: bool = False) -> subprocess.CompletedProcess[str]:
    # -P: the working directory is not put on sys.path, as for the installed `castwise` script
    flags = ["-P"] if safe_path else []
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, *flags, "-m", "castwise", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_load_target_from_a_file_and_from_a_module() -> None:
    model, inputs = load_target(f"{FIXTURES / 'CW105_input_dtype.py'}:build")
    assert isinstance(model, nn.Sequential) and isinstance(inputs, tuple)
    model, _inputs = load_target("castwise.stories:build_encoder")
    assert type(model).__name__ == "PoseAutoEncoder"


BAD_BUILDERS = """
import sys
import torch
from torch import nn

def three():
    return nn.Linear(2, 2), torch.randn(1, 2), torch.randn(1, 2)

def swapped():
    return torch.randn(1, 2), nn.Linear(2, 2)

def a_list():
    return [nn.Linear(2, 2), torch.randn(1, 2)]

def number():
    return 3

def exits():
    sys.exit(3)
"""


def test_bad_target_forms_say_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(BAD_BUILDERS)
    cases = {
        "no_colon": "target 'no_colon' names no function; valid forms: module:function, path/file.py:function, "
        "path/config.json, hf:PATH_OR_DIR",
        f"{bad}:not-a-name": "'not-a-name' is not a function name; valid forms:",
        f"{tmp_path / 'missing.py'}:build": f"no file '{tmp_path / 'missing.py'}'",
        f"{bad}:nothing": "has no function 'nothing'; functions there: a_list, exits, number, swapped, three",
        "castwise.nonexistent:build": "cannot import module 'castwise.nonexistent' (ModuleNotFoundError",
        f"{bad}:three": "must return (model, inputs) with an nn.Module first; got a tuple of 3 items "
        "(Linear, Tensor, Tensor) (put several inputs in one tuple or dict: model, (x, mask))",
        f"{bad}:swapped": "got (Tensor, Linear): swap them, the model comes first",
        f"{bad}:a_list": "got list of 2 (return model, inputs as a tuple)",
        f"{bad}:number": "got int",
        f"{bad}:exits": "exits() raised SystemExit: it called sys.exit(3)",
    }
    for target, message in cases.items():
        with pytest.raises(TargetError) as info:
            load_target(target)
        assert message in str(info.value), (target, str(info.value))


def test_a_builder_calling_sys_exit_is_an_error_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.py").write_text(BAD_BUILDERS)
    assert main(["audit", f"{tmp_path / 'bad.py'}:exits"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("castwise: error: target ") and "called sys.exit(3)" in err


def test_a_package_module_target_from_the_project_root(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            from pkg import layers  # a lazy import inside the project: needs the root on sys.path too
            return layers.net(), (torch.randn(2, 4),)
    """)
    )
    (tmp_path / "pkg" / "layers.py").write_text("from torch import nn\n\ndef net():\n    return nn.Linear(4, 2)\n")
    p = _cli("audit", "pkg.mod:build", "--mode", "eval", cwd=tmp_path, safe_path=True)
    assert p.returncode == 0, p.stderr
    assert "no findings" in p.stdout
    assert str(tmp_path) not in sys.path


def _llama(folder: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    return folder / "config.json"


def test_a_config_json_builds_its_architecture_on_meta_with_token_ids(tmp_path: Path) -> None:
    config = _llama(tmp_path / "llama")
    for target in (str(config), f"hf:{config.parent}", str(config.parent)):
        model, inputs = load_target(target, seq_len=12)
        assert type(model).__name__ == "LlamaForCausalLM"
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert list(inputs) == ["input_ids"] and inputs["input_ids"].shape == (1, 12)
        assert inputs["input_ids"].dtype == torch.long and int(inputs["input_ids"].max()) < 100
    _model, inputs = load_target(str(config))
    assert inputs["input_ids"].shape == (1, 128)


def test_encoder_decoder_and_vision_configs_get_their_inputs(tmp_path: Path) -> None:
    from transformers import T5Config, ViTConfig

    T5Config(
        d_model=32,
        d_ff=64,
        num_layers=1,
        num_heads=2,
        d_kv=16,
        vocab_size=64,
        architectures=["T5ForConditionalGeneration"],
    ).save_pretrained(tmp_path / "t5")
    model, inputs = load_target(f"hf:{tmp_path / 't5'}", seq_len=8)
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert sorted(inputs) == ["decoder_input_ids", "input_ids"] and inputs["decoder_input_ids"].shape == (1, 8)

    ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    ).save_pretrained(tmp_path / "vit")
    model, inputs = load_target(str(tmp_path / "vit" / "config.json"))
    assert type(model).__name__ == "ViTModel"  # no architectures: the bare model
    assert list(inputs) == ["pixel_values"] and inputs["pixel_values"].shape == (1, 3, 32, 32)


def test_config_targets_that_cannot_be_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import WhisperConfig

    small = {
        "d_model": 32,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "vocab_size": 64,
        "num_mel_bins": 8,
    }
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
    WhisperConfig(**small, **ids).save_pretrained(tmp_path / "whisper")
    WhisperConfig(**small).save_pretrained(tmp_path / "broken")  # pad id 50256 outside the vocabulary
    (tmp_path / "not_a_config.json").write_text('{"learning_rate": 0.1}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "model.py").write_text("def build():\n    pass\n")
    cases = {
        f"hf:{tmp_path / 'whisper'}": "WhisperModel.forward takes 'input_features' first; write a builder function",
        str(tmp_path / "broken" / "config.json"): "transformers cannot build whisper from this config "
        "(AssertionError: Padding_idx must be within num_embeddings)",
        str(tmp_path / "not_a_config.json"): "is not a transformers model config (ValueError: Unrecognized model",
        f"hf:{tmp_path / 'empty'}": "has no config.json; valid forms:",
        "hf:meta-llama/Llama-2-7b": "castwise reads local configs only, nothing from the hub",
    }
    for target, message in cases.items():
        with pytest.raises(TargetError) as info:
            load_target(target)
        assert message in str(info.value), (target, str(info.value))
    with pytest.raises(TargetError, match="--seq-len applies to config targets"):
        load_target(f"{tmp_path / 'model.py'}:build", seq_len=8)
    config = _llama(tmp_path / "llama")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if transformers were not installed
    with pytest.raises(TargetError, match="needs transformers: pip install transformers"):
        load_target(str(config))


def test_cli_audits_a_config_json(tmp_path: Path) -> None:
    config = _llama(tmp_path / "llama")
    p = _cli("audit", str(config), "--policy", "bf16-mixed", "--seq-len", "8", "--json", "-", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert [r["status"] for r in report["runs"]] == ["ok", "ok"]
    assert report["summary"]["params_by_dtype"]
    refused = _cli("audit", f"hf:{config.parent}", "--real", cwd=tmp_path)
    assert refused.returncode == 2 and "--real cannot run it" in refused.stderr
