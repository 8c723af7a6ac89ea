"""castwise ledger CHECKPOINT: the dtypes a file holds (torch.save read onto meta with
weights_only=True, safetensors by its header), and CW155 against the run it resumes into."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from castwise.cli import main
from castwise.errors import CastwiseError
from castwise.ledger.checkpoint import ledger_from_checkpoint

BUILD = """import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)){cast}, torch.randn(2, 8){cast}
"""


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).bfloat16()
    model.register_buffer("scale", torch.ones(3, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-4}])
    model(torch.randn(2, 8).bfloat16()).float().sum().backward()
    opt.step()
    return model, opt


def _values(ledger: object, field: str) -> dict[str, str]:
    return {n: r.values()[field] for r in ledger.rows for n in r.params}  # type: ignore[attr-defined]


def test_lightning_checkpoint_pairs_optimizer_state_with_the_model(tmp_path: Path) -> None:
    model, opt = _trained()
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 3}, path)
    ledger = ledger_from_checkpoint(path)
    assert _values(ledger, "storage") == dict.fromkeys(
        ["0.weight", "0.bias", "1.weight", "1.bias", "scale"], "bfloat16"
    )
    assert _values(ledger, "state") == {
        **dict.fromkeys(["0.weight", "0.bias", "1.weight", "1.bias"], "bfloat16"),
        "scale": "unknown",
    }
    assert [r.state.source for r in ledger.rows][:2] == [
        "optimizer param group 0 (lr=0.001)",
        "optimizer param group 1 (lr=0.0001)",
    ]


def test_optimizer_state_alone_and_safetensors(tmp_path: Path) -> None:
    model, opt = _trained()
    opt.state[model[0].weight]["exp_avg"] = opt.state[model[0].weight]["exp_avg"].float()  # a wider moment
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    ledger = ledger_from_checkpoint(tmp_path / "optimizer.pt")
    assert _values(ledger, "state")["param 0"] == "bfloat16/float32"  # exp_avg f32, exp_avg_sq bf16
    assert _values(ledger, "storage")["param 0"] == "unknown"  # no model in the file: never guessed
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    st = ledger_from_checkpoint(tmp_path / "model.safetensors")
    assert set(_values(st, "storage").values()) == {"bfloat16"} and len(_values(st, "storage")) == 5


def test_a_file_with_code_is_refused_and_not_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("RAN CODE FROM THE FILE",))

    torch.save({"x": Boom()}, tmp_path / "evil.pt")
    with pytest.raises(CastwiseError, match="Unsupported global"):
        ledger_from_checkpoint(tmp_path / "evil.pt")
    assert "RAN CODE" not in capsys.readouterr().out
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 4)
    with pytest.raises(CastwiseError, match="not a safetensors file"):
        ledger_from_checkpoint(tmp_path / "bad.safetensors")


def test_cw155_resume_into_f32_names_the_fields_and_bf16_control(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt = _trained()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    (tmp_path / "f32.py").write_text(BUILD.format(cast=""))
    (tmp_path / "bf16.py").write_text(BUILD.format(cast=".bfloat16()"))
    main(["ledger", str(path), "--against", f"{tmp_path / 'f32.py'}:build", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    (f,) = data["findings"]
    assert f["code"] == "CW155"
    changes = f["message"]
    assert "storage bf16 -> f32 (0.weight, 0.bias)" in changes and "state bf16 -> f32 (1.weight, 1.bias)" in changes
    assert "scale" not in changes  # a buffer: not in the run's ledger, not compared
    # the real resume agrees: torch casts the saved bf16 moments to the f32 parameters' dtype
    f32 = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    fresh = torch.optim.AdamW([{"params": f32[0].parameters()}, {"params": f32[1].parameters(), "lr": 1e-4}])
    fresh.load_state_dict(torch.load(path, weights_only=True)["optimizer"])
    assert fresh.state[f32[1].weight]["exp_avg"].dtype == torch.float32
    main(["ledger", str(path), "--against", f"{tmp_path / 'bf16.py'}:build", "--json", "-"])
    assert json.loads(capsys.readouterr().out)["findings"] == []  # the same precision: nothing changes
    assert main(["ledger", str(tmp_path / "bf16.py"), "--against", str(path)]) == 2
    assert "--against goes with a checkpoint file" in capsys.readouterr().err
