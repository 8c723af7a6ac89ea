"""Per-release autocast (issue 36): the recorded lists, autocast emulated as another release ran
it, the two-release diff, and the CLI's ``--torch``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import castwise
from castwise import _releases as releases
from castwise._autocast import autocast, emulated
from castwise.auditor.entry import release_changes
from castwise.cli.audit import audit as audit_command
from castwise.run import check

ROOT = Path(__file__).parent.parent
RUNNING = releases.release_of(torch.__version__)
NEWEST = releases.recorded()[-1]  # rms_norm on CUDA autocast's f32 list (2.12 on)
OTHERS = [r for r in releases.recorded() if r != RUNNING]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("record_torch_release", ROOT / "scripts/record_torch_release.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def probe() -> Any:
    """classify(name, device) of the recording script, under bf16 autocast on fake tensors."""
    script, fake = _script(), FakeTensorMode(allow_non_fake_inputs=True)

    def classify(name: str, device: str) -> str:
        with autocast(device, torch.bfloat16):
            return str(script.classify(script._op(name), name, device, fake)[0])

    return classify


class Block(nn.Module):
    """QK-norm in Flux's manner: a projection, an RMSNorm, a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.q(x)))


def _norm_out(report: castwise.Report) -> list[str]:
    return next(m["outputs"] for m in report.summary["modules"] if m["name"] == "norm")


def test_the_running_release_is_recorded_and_the_recording_is_what_its_autocast_does(probe: Any) -> None:
    assert RUNNING in releases.recorded()
    lists = releases.load(RUNNING)
    script_keys = _script().KEYS
    # one op of each kind, measured again here on this torch's own autocast kernels
    for device, names in {
        "cuda": [
            "aten::mm",
            "aten::rms_norm",
            "aten::exp",
            "aten::cumsum",
            "aten::addcmul",
            "aten::binary_cross_entropy",
        ],
        "cpu": ["aten::mm", "aten::mse_loss", "aten::cat"],
    }.items():
        registered = torch._C._dispatch_get_registrations_for_dispatch_key(script_keys[device])
        for name in names:
            # an op with no autocast kernel here (rms_norm before 2.12) is in no list
            expected = probe(name, device) if name in registered else None
            assert expected == lists.category(device, name), (device, name)
    # a look-alike: an op autocast does not list is in no category
    assert lists.category("cuda", "aten::add.Tensor") is None and lists.category("cpu", "aten::exp") is None


@pytest.mark.parametrize("release", OTHERS)
def test_emulated_release_casts_each_changed_op_as_recorded_and_restores(probe: Any, release: str) -> None:
    here, there = releases.load(RUNNING), releases.load(release)
    for device in ("cuda", "cpu"):
        changed = here.changed(there, device)
        with emulated(release):
            seen = {
                name: probe(name, device)
                for name, (_now, then) in changed.items()
                if then is not None and hasattr(torch.ops.aten, name.removeprefix("aten::").split(".")[0])
            }
        for name, category in seen.items():
            assert category == there.category(device, name), (release, device, name)
        # this torch's own kernels are back
        for name in [n for n in seen if here.category(device, n) is not None][:5]:
            assert probe(name, device) == here.category(device, name), (release, device, name)


def test_emulation_is_undone_when_the_run_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), emulated(OTHERS[0] if OTHERS else None):
        raise RuntimeError("boom")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        x = torch.ones(4, 4, device="cuda", dtype=torch.bfloat16)
    with fake, autocast("cuda", torch.bfloat16):
        # as this torch does: f32 from 2.12 on, the input's bf16 before
        kept = releases.load(RUNNING).category("cuda", "aten::rms_norm") == "fp32"
        assert torch.ops.aten.rms_norm.default(x, [4]).dtype == (torch.float32 if kept else torch.bfloat16)


def _changed_norm_release() -> str:
    """A recorded release whose CUDA autocast leaves rms_norm to its input's dtype (before 2.12)."""
    for release in releases.recorded():
        if releases.load(release).category("cuda", "aten::rms_norm") is None:
            return release
    pytest.skip("no recorded release without rms_norm on CUDA autocast's f32 list")


def test_audit_as_an_older_release_runs_the_norm_in_bf16_and_the_linears_alike() -> None:
    old = _changed_norm_release()
    model, x = Block(), torch.randn(2, 8)
    now = castwise.audit(model, x, policy="bf16-mixed", device="cuda", mode="eval", torch=NEWEST)
    then = castwise.audit(model, x, policy="bf16-mixed", device="cuda", mode="eval", torch=old)
    assert _norm_out(now) == ["f32[2, 8]"] and _norm_out(then) == ["bf16[2, 8]"]
    flows = [{m["name"]: m["outputs"] for m in r.summary["modules"]} for r in (now, then)]
    assert flows[0]["q"] == flows[1]["q"] == ["bf16[2, 8]"]  # mm is lower precision in both
    # the CPU's autocast never listed rms_norm: the release changes nothing there
    cpu = [castwise.audit(model, x, policy="bf16-mixed", device="cpu", mode="eval", torch=t) for t in (None, old)]
    assert _norm_out(cpu[0]) == _norm_out(cpu[1])


def test_release_changes_lists_the_norm_and_its_consumers_only() -> None:
    old = _changed_norm_release()
    request = check("audit", Block(), torch.randn(2, 8), policy="bf16-mixed", device="cuda")
    diff = release_changes(request, old, NEWEST)
    names = [m["module"] for m in diff["modules"]]
    assert "norm" in names and "q" not in names
    norm = next(m for m in diff["modules"] if m["module"] == "norm")
    assert norm[old]["outputs"] == ["bf16[2, 8]"] and norm[NEWEST]["outputs"] == ["f32[2, 8]"]
    assert diff["autocast"]["aten::rms_norm"] == (None, "fp32")
    # the same release twice: nothing changes
    assert release_changes(request, RUNNING, RUNNING)["modules"] == []


def test_since_names_the_release_that_brought_rms_norm_to_f32() -> None:
    old = _changed_norm_release()
    later = [r for r in releases.recorded() if releases._key(r) > releases._key(old)]
    first = next(r for r in later if releases.load(r).category("cuda", "aten::rms_norm") == "fp32")
    assert releases.since("aten::rms_norm", "cuda", NEWEST) == (
        f"since torch {first}, rms_norm runs in f32 under CUDA autocast"
    )
    assert releases.since("aten::mm", "cuda", NEWEST) is None  # lower precision in every recorded release
    assert releases.cause_note(("aten._fused_rms_norm.default",), "cuda", NEWEST) is not None
    assert releases.cause_note(("aten.add.Tensor",), "cuda", NEWEST) is None


@pytest.mark.parametrize("value", ["2.9", "two", "2", 2.11])
def test_an_unrecorded_or_malformed_release_is_a_clear_error(value: object) -> None:
    with pytest.raises(releases.TorchReleaseError, match="valid: " + ", ".join(releases.recorded())):
        castwise.audit(Block(), torch.randn(2, 8), torch=value)  # type: ignore[arg-type]


BUILDER = """\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.norm(self.q(x)))


def build():
    return Block(), (torch.randn(2, 8),)
"""


def test_cli_torch_pair_prints_the_changed_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _changed_norm_release()
    (tmp_path / "block.py").write_text(BUILDER, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    target = f"{tmp_path / 'block.py'}:build"
    args = [target, "-p", "bf16-mixed", "--device", "cuda", "--torch", f"{old},{NEWEST}"]
    result = CliRunner().invoke(audit_command, args, standalone_mode=False)
    assert result.exception is None, result.output
    assert f"norm (RMSNorm)\n  outputs: bf16[2, 8] (torch {old}) -> f32[2, 8] (torch {NEWEST})" in result.output
    assert "q (Linear)" not in result.output
    data = json.loads(CliRunner().invoke(audit_command, [*args, "--json", "-"], standalone_mode=False).output)
    assert [m["module"] for m in data["modules"]] == [
        m for m in ("norm", "out") if m in {x["module"] for x in data["modules"]}
    ]


def test_cli_bad_torch_value_fails_before_the_model_loads(tmp_path: Path) -> None:
    args = [f"{tmp_path}/missing.py:build", "--torch", "2.9"]
    result = CliRunner().invoke(audit_command, args, standalone_mode=False)
    assert result.return_value == 2 and "no autocast lists recorded for torch 2.9" in result.output
    assert "missing.py" not in result.output  # the release was checked first


def test_the_release_lists_import_without_torch() -> None:
    code = "import sys, castwise._releases as r; r.load(r.recorded()[0]); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(ROOT / "src")})
