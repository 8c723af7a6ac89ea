"""`castwise audit TARGET --json -`: stdout carries the JSON alone, whatever the user's code prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parent.parent.parent / "src"

# a builder in nanoGPT's manner: it prints while its module imports, while it builds, and in forward
CHATTY = """\
import torch
from torch import nn

print("importing the model code")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        print(f"number of parameters: {sum(p.numel() for p in self.parameters()) / 1e6:.2f}M")

    def forward(self, x):
        print("forward", tuple(x.shape))
        return self.fc(x)


def build():
    return Net(), (torch.randn(2, 8),)
"""


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, "-m", "castwise", *map(str, args)], capture_output=True, text=True, timeout=300, env=env
    )


def test_json_on_stdout_stays_json_when_the_builder_prints(tmp_path: Path) -> None:
    (tmp_path / "chatty.py").write_text(CHATTY, encoding="utf-8")
    p = run_cli("audit", tmp_path / "chatty.py:build", "--policy", "bf16-mixed", "--json", "-")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["findings"] is not None
    # what the user's code printed is not lost: it went to stderr
    assert "number of parameters: 0.00M" in p.stderr and "importing the model code" in p.stderr


def test_without_json_on_stdout_the_users_prints_stay_on_stdout(tmp_path: Path) -> None:
    (tmp_path / "chatty.py").write_text(CHATTY, encoding="utf-8")
    p = run_cli("audit", tmp_path / "chatty.py:build", "--policy", "bf16-mixed")
    assert p.returncode == 0, p.stderr
    assert "number of parameters: 0.00M" in p.stdout


def test_a_real_audit_verifies_the_silent_findings_fixes() -> None:
    fixture = Path(__file__).resolve().parents[1] / "rules" / "fixtures" / "CW140_loss_in_bf16.py"
    found = {}
    for real in (False, True):
        p = run_cli(
            "audit", f"{fixture}:build", "--policy", "bf16-true", "--mode", "eval", "--json", "-", *(["--real"] * real)
        )
        assert p.returncode == 0, p.stderr
        (f,) = [f for f in json.loads(p.stdout)["findings"] if f["code"] == "CW140"]
        found[real] = f
    assert "Not verified: the audit ran on fake tensors" in found[False]["fix"], found[False]
    assert "Verified: `out[lm_head]=f32,output=f32`" in found[True]["fix"], found[True]
