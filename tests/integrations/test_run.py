"""castwise run: a user's script as python runs it, each model audited at its first forward."""

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

from castwise.integrations.run import Watcher, ambient_policy, run_script

CLEAN = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("args", sys.argv[1:])
for step in range(3):
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.6f}")
"""

# trains under CPU autocast, then validation takes the fused encoder fast path and crashes
VALIDATION_CRASH = """
import torch
from castwise.stories import build_encoder

model, (x, mask) = build_encoder()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model.train()
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = model(x, mask).float().pow(2).mean()
loss.backward()
opt.step()
print("step 0 done", flush=True)
model.eval()
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    print("val", model(x, mask).float().mean().item())
"""

# a bf16 table made by hand, multiplied into float32 activations: fails at the first step
PLANTED = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, scale=None):
        table = torch.ones(8, 8, dtype=torch.bfloat16)
        return self.head(self.proj(x) @ table)

model = Model()
out = model(torch.randn(2, 8), scale=1.0)
print("never printed")
"""


def _castwise(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "castwise", "run", *args, str(path), "a", "--lr", "3"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )


def test_a_clean_script_prints_exactly_what_it_prints_alone(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(CLEAN))
    alone = subprocess.run([sys.executable, str(path), "a", "--lr", "3"], capture_output=True, text=True, check=True)
    watched = _castwise(tmp_path, CLEAN, "--json", str(tmp_path / "r.json"))
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout == alone.stdout  # same argv, same batches, same losses
    assert "args ['a', '--lr', '3']" in watched.stdout
    assert "castwise run: Sequential at its first forward" in watched.stderr
    assert "policy bf16-mixed" in watched.stderr  # the script's own autocast
    data = json.loads((tmp_path / "r.json").read_text())
    assert [m["model"] for m in data["models"]] == ["Sequential"]
    assert [f for f in data["models"][0]["findings"] if f["severity"] == "error"] == []


def test_a_validation_crash_is_reported_before_the_first_step(tmp_path: Path) -> None:
    out = _castwise(tmp_path, VALIDATION_CRASH)
    assert out.returncode == 1
    assert "step 0 done" in out.stdout  # the script ran on, as it would
    finding = out.stderr.index("error CW103 fast-path-ignores-autocast  [eval]")
    assert "fastpath=off" in out.stderr[finding:]
    assert out.stderr.index("expected scalar type Float but found BFloat16", finding) > finding


def test_stop_ends_the_script_at_the_first_error_finding(tmp_path: Path) -> None:
    out = _castwise(tmp_path, VALIDATION_CRASH, "--stop")
    assert out.returncode == 1
    assert "step 0 done" not in out.stdout
    assert "castwise run --stop: PoseAutoEncoder: CW103" in out.stderr


def test_a_planted_bug_is_found_with_keyword_arguments(tmp_path: Path) -> None:
    out = _castwise(tmp_path, PLANTED, "--json", str(tmp_path / "r.json"))
    assert out.returncode == 1
    assert "never printed" not in out.stdout
    (model,) = json.loads((tmp_path / "r.json").read_text())["models"]
    errors = [f for f in model["findings"] if f["severity"] == "error"]
    assert errors and errors[0]["code"] == "CW106", out.stderr  # the tensor made in forward
    assert "torch.ones" in errors[0]["message"] or "aten.ones" in errors[0]["message"]


def test_json_to_stdout_is_refused_the_scripts_stdout_is_its_own(tmp_path: Path) -> None:
    out = _castwise(tmp_path, CLEAN, "--json", "-")
    assert out.returncode == 2 and "needs a file" in out.stderr and out.stdout == ""


def test_the_script_exit_code_is_kept(tmp_path: Path) -> None:
    out = _castwise(tmp_path, "import sys\nsys.exit(7)\n")
    assert out.returncode == 7


def test_the_watcher_leaves_module_call_rng_and_argv_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "s.py"
    path.write_text("import torch\nfrom torch import nn\nm = nn.Linear(4, 4)\nm(torch.randn(2, 4))\n")
    call, argv, scaler_init = nn.Module.__call__, list(sys.argv), torch.amp.GradScaler.__init__
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    watcher = Watcher()
    assert run_script(str(path), ["x"], watcher) == 0
    assert nn.Module.__call__ is call and sys.argv == argv and torch.amp.GradScaler.__init__ is scaler_init
    assert [name for name, _ in watcher.reports] == ["Linear"]
    # the script drew its own numbers (randn); the audit drew none the script would have seen
    torch.manual_seed(1)
    assert torch.equal(torch.rand(3), expected)


def test_ambient_policy_is_the_scripts_own_autocast() -> None:
    assert ambient_policy("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ambient_policy("cpu") == "bf16-mixed,keep_in_fp32=off"


@pytest.mark.parametrize("inner_first", [True, False])
def test_only_root_calls_are_audited_once(tmp_path: Path, inner_first: bool) -> None:
    outer = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    watcher = Watcher(mode="eval")
    with watcher.watching():
        if inner_first:
            outer[0](torch.randn(1, 4))  # a submodule called on its own is a root call too
        for _ in range(3):
            outer(torch.randn(1, 4))
    names = [n for n, _ in watcher.reports]
    assert names == (["Linear", "Sequential"] if inner_first else ["Sequential"])


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_only_rank_0_audits_and_reports(tmp_path: Path, rank: str) -> None:
    """torchrun / accelerate launch start one process per rank with RANK and LOCAL_RANK set: rank
    0 audits and reports for all; the others run the script unwatched (no audit, no JSON)."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(CLEAN))
    report = tmp_path / f"r{rank}.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2"}
    out = subprocess.run(
        [sys.executable, "-m", "castwise", "run", "--json", str(report), str(path), "a", "--lr", "3"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "step 2 loss" in out.stdout
    assert ("castwise run: Sequential at its first forward" in out.stderr) == (rank == "0")
    assert report.exists() == (rank == "0")


def test_a_forward_with_var_keywords_is_audited_with_its_keywords() -> None:
    """forward(self, x, **kwargs), called with keywords: the keywords are passed on by name."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.lin(x) * kwargs["scale"]
            return out

    watcher = Watcher(mode="eval")
    with watcher.watching():
        Net()(torch.randn(2, 4), scale=torch.ones(4))
    assert [name for name, _ in watcher.reports] == ["Net"]


def test_a_module_runs_from_the_current_directory_as_python_m_runs_it(tmp_path: Path) -> None:
    """`castwise run -m pkg.train` from a repository's root imports `pkg` from there, as `python -m`
    does; the `castwise` entry point (not `python -m castwise`, which has the directory already)."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("WIDTH = 8\n")
    (pkg / "train.py").write_text("from mypkg.helpers import WIDTH\nprint('width', WIDTH)\n")
    entry = Path(sys.executable).with_name("castwise")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [str(entry), "run", "-m", "mypkg.train"], capture_output=True, text=True, env=env, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "width 8\n"


CRASH = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 3:
            raise ValueError("a bug of the script's own")
        return self.l(x)

model = Model()
model(torch.randn(2, 4)).sum().backward()
model(torch.randn(3, 4))
"""


def test_the_scripts_own_error_prints_the_traceback_python_prints(tmp_path: Path) -> None:
    """No frame of castwise's runner (the command, runpy, the watcher's call wrapper) in the user's
    traceback: the same frames, files and lines as `python train.py`."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(CRASH))
    alone = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path, check=False)
    watched = _castwise(tmp_path, CRASH)
    assert alone.returncode == watched.returncode == 1

    def traceback_of(stderr: str) -> str:
        return stderr[stderr.index("Traceback (most recent call last):") :]

    assert traceback_of(watched.stderr) == traceback_of(alone.stderr)
