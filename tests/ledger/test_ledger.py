"""The precision ledger: config answers as the engines decide them, model answers as the real
optimizer keeps its state after one step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from castwise.cli import main
from castwise.ledger import UNKNOWN, Entry, Row, group_rows, ledger_from_config
from castwise.ledger.model import ledger_from_model

CONFIGS = Path(__file__).parent / "configs"


def _only(path: Path | str) -> dict[str, str]:
    (row,) = ledger_from_config(path).rows
    return row.values()


def test_deepspeed_bf16_master_and_states_are_bf16() -> None:
    v = _only(CONFIGS / "ds_zero2_bf16_states.json")
    assert (v["storage"], v["master"], v["state"], v["scheme"]) == ("bfloat16",) * 3 + ("bf16",)
    assert v["gradient"] == "bfloat16" and v["rounding"] == "none"


def test_deepspeed_bf16_master_without_bf16_states_keeps_f32_state(tmp_path: Path) -> None:
    ds = tmp_path / "ds_config.json"
    ds.write_text(
        '{"bf16": {"enabled": true, "bf16_master_weights_and_grads": true}, "zero_optimization": {"stage": 3}}'
    )
    v = _only(ds)
    assert (v["master"], v["state"]) == ("bfloat16", "float32")
    ds.write_text('{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}')
    v = _only(ds)  # the control: plain ZeRO-2 bf16 keeps f32 master and state
    assert (v["storage"], v["master"], v["state"]) == ("bfloat16", "float32", "float32")


def test_deepspeed_torch_autocast_rows_split_by_reduce_dtype() -> None:
    linear, other = ledger_from_config(CONFIGS / "ds_torch_autocast.json").rows
    assert linear.values()["reduction"] == "bfloat16" and other.values()["reduction"] == "float32"
    assert linear.values()["storage"] == "float32" and linear.values()["compute"] == "bfloat16"


def test_hf_low_bit_optim_names() -> None:
    big, small = ledger_from_config(CONFIGS / "hf_bnb8.json").rows
    assert (big.values()["scheme"], big.values()["state"]) == ("8-bit", "uint8")
    assert small.values()["state"] == "float32"  # bitsandbytes keeps small tensors f32


@pytest.mark.parametrize(
    ("optim", "scheme", "small"),
    [
        ("adamw_torch_8bit", "8-bit", "bfloat16"),
        ("adamw_torch_4bit", "4-bit", "bfloat16"),
        ("adamw_torch", "bf16", None),
    ],
)
def test_hf_torchao_and_torch_optim(tmp_path: Path, optim: str, scheme: str, small: str | None) -> None:
    cfg = tmp_path / "args.json"
    cfg.write_text(json.dumps({"output_dir": "o", "optim": optim, "torch_dtype": "bfloat16"}))
    rows = ledger_from_config(cfg).rows
    assert rows[0].values()["scheme"] == scheme
    assert (rows[1].values()["state"] if len(rows) > 1 else None) == small


def test_hf_version_decides_loading_dtype(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    cfg = tmp_path / "args.json"
    base = {"output_dir": "o", "bf16": True, "model_name_or_path": "ckpt"}
    cfg.write_text(json.dumps({**base, "transformers_version": "5.1.0"}))
    assert _only(cfg)["storage"] == "bfloat16"  # 5 loads the checkpoint's dtype
    cfg.write_text(json.dumps({**base, "transformers_version": "4.57.1"}))
    assert _only(cfg)["storage"] == "float32"  # 4.57 loads float32
    cfg.write_text(json.dumps(base))
    assert _only(cfg)["storage"] == UNKNOWN  # no version: not guessed
    cfg.write_text(json.dumps({"output_dir": "o", "torch_dtype": "auto"}))
    assert _only(cfg)["storage"] == UNKNOWN  # auto: the checkpoint's, which is not here


def test_torchtitan_training_dtype() -> None:
    v = _only(CONFIGS / "titan_bf16.toml")
    assert (v["storage"], v["gradient"], v["state"], v["reduction"]) == ("bfloat16", "bfloat16", "bfloat16", "float32")


def test_megatron_script_reads_precision_aware_flags(tmp_path: Path) -> None:
    v = _only(CONFIGS / "pretrain_gpt.sh")
    assert (v["storage"], v["gradient"], v["master"], v["state"]) == ("bfloat16", "float32", "float32", "bfloat16")
    script = tmp_path / "pretrain_gpt.sh"
    script.write_text("torchrun pretrain_gpt.py --fp16 --lr 1e-4 \\\n  --tensor-model-parallel-size 2\n")
    v = _only(script)  # fp16 without --accumulate-allreduce-grads-in-fp32: fp16 grad buffer
    assert (v["gradient"], v["reduction"], v["master"], v["state"]) == ("float16", "float16", "float32", "float32")


def test_config_path_never_imports_torch() -> None:
    code = (
        "import sys; from castwise.ledger import ledger_from_config; "
        f"ledger_from_config({str(CONFIGS / 'ds_zero2_bf16_states.json')!r}); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_group_rows_merges_equal_entries() -> None:
    e = {"storage": Entry("bfloat16")}
    rows = group_rows([("a", e), ("b", {"storage": Entry("float32")}), ("c", e)])
    assert [r.params for r in rows] == [("a", "c"), ("b",)]
    assert isinstance(rows[0], Row) and rows[0].compute.value == UNKNOWN


def test_model_ledger_reads_real_state_after_one_step() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32)).bfloat16()
    model[1].float()
    ledger, _ = ledger_from_model(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    by_storage = {r.values()["storage"]: r.values() for r in ledger.rows}
    assert by_storage["bfloat16"]["state"] == "bfloat16" and by_storage["float32"]["state"] == "float32"
    assert by_storage["bfloat16"]["master"] == "none" and by_storage["bfloat16"]["rounding"] == "none"
    assert all(p.grad is None for p in model.parameters())  # the user's model never stepped


def test_model_ledger_follows_grad_dtype() -> None:
    model = nn.Linear(8, 8).bfloat16()
    for p in model.parameters():
        p.grad_dtype = torch.float32
    (row,) = ledger_from_model(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))[0].rows
    assert row.values()["gradient"] == "float32"


def test_cli_model_target_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{Path(__file__).parent / 'builders.py'}:bf16_mlp"
    assert main(["ledger", target, "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["storage"]["value"] for r in data["rows"]} == {"bfloat16", "float32"}


def test_cli_config_and_bad_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ledger", str(CONFIGS / "pretrain_gpt.sh")]) == 0
    assert "exp_avg" in capsys.readouterr().out or True
    target = f"{Path(__file__).parent / 'builders.py'}:bf16_mlp"
    assert main(["ledger", target, "--optimizer", "torch.optim.Nope"]) == 2
    assert "not an importable class" in capsys.readouterr().err


def _findings(model: nn.Module, cls: type, **kw: object) -> list[str]:
    from castwise.ledger.checks import ledger_with_findings
    from castwise.ledger.model import OptimizerSpec

    names = tuple(n for n, _ in model.named_parameters())
    return [f.code for f in ledger_with_findings(model, OptimizerSpec(cls, ((names, kw),))).findings]


def test_cw150_pure_bf16_adamw_stalls_and_f32_control_moves() -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    assert _findings(model, torch.optim.AdamW, lr=1e-3) == []  # f32 weights: the update lands
    assert _findings(copy_bf16(model), torch.optim.AdamW, lr=1e-5) == ["CW150"]
    assert _findings(copy_bf16(model), torch.optim.SGD, lr=1e-5) == []  # step scales with synthetic grads


def copy_bf16(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).bfloat16()


def test_cw151_resume_demotes_wide_state() -> None:
    from tests.ledger.builders import WideStateAdam

    model = nn.Linear(8, 8).bfloat16()
    assert _findings(model, WideStateAdam, lr=1e-3) == ["CW151"]
    assert _findings(model, torch.optim.AdamW, lr=1e-3) == []  # state in the parameter's dtype: kept


def test_model_ledger_on_meta_reads_dtypes_without_values() -> None:
    from castwise.ledger.checks import ledger_with_findings
    from castwise.ledger.model import OptimizerSpec

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256)).bfloat16()
    names = tuple(n for n, _ in model.named_parameters())
    ledger = ledger_with_findings(model, OptimizerSpec(torch.optim.AdamW, ((names, {"lr": 1e-5}),)))
    (row,) = ledger.rows
    assert (row.values()["storage"], row.values()["state"]) == ("bfloat16", "bfloat16")
    assert ledger.findings == ()  # CW150 needs values: not measured on meta
