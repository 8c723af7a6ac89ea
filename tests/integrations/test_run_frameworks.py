"""castwise run on scripts whose framework runs the model in its own precision (Lightning Fabric,
Accelerate): the audit runs the user's module under the policy that models the framework's
precision (named in the report, replaced by ``--policy``, on the ``--device`` asked for) and its
backward as the framework runs it; castwise's own presets say where Lightning's differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from castwise.integrations.frameworks import framed, framework_backward, preset_note
from castwise.policy import Policy

SCRIPTS = Path(__file__).parent / "scripts"

FABRIC = """
import lightning as L
import torch
from torch import nn

fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(2):
    loss = model(torch.randn(4, 8)).float().pow(2).mean()
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.6f}")
"""


def _run(
    tmp_path: Path, script: Path, *args: str, options: tuple[str, ...] = (), **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "castwise", "run", "--json", str(report), *options, str(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
        cwd=tmp_path,
        check=False,
    )
    return out, json.loads(report.read_text()) if report.exists() else {}


def _alone(tmp_path: Path, script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
        cwd=tmp_path,
        check=False,
    )


def _errors(data: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["model"], f["code"]) for m in data["models"] for f in m["findings"] if f["severity"] == "error"]


def test_a_fabric_script_under_bf16_mixed_is_audited_in_fabrics_precision(tmp_path: Path) -> None:
    """No false CW130: the audit's backward is not refused by Fabric's guard (loss.backward() in
    place of fabric.backward), and the report names Fabric's precision as its policy."""
    script = tmp_path / "train.py"
    script.write_text(FABRIC)
    alone = _alone(tmp_path, script)
    out, data = _run(tmp_path, script)
    assert out.returncode == 0, out.stderr
    assert out.stdout == alone.stdout
    (model,) = data["models"]
    assert model["model"] == "Sequential"  # the user's module, not Fabric's wrapper
    assert _errors(data) == []
    assert {r["policy"] for r in model["runs"]} == {"bf16-mixed,inputs=bf16"}
    assert model["framework"] == {
        "name": "Lightning Fabric",
        "setting": "precision='bf16-mixed'",
        "policy": "lightning:bf16-mixed,inputs=bf16",
        "replaced_by": None,
    }
    assert "= Lightning Fabric's precision='bf16-mixed'" in " ".join(out.stderr.split())


def test_stop_runs_a_healthy_litgpt_style_pretrain_to_completion(tmp_path: Path) -> None:
    script = SCRIPTS / "litgpt_pretrain.py"
    alone = _alone(tmp_path, script)
    assert alone.returncode == 0, alone.stderr
    out, data = _run(tmp_path, script, options=("--stop",))
    assert out.returncode == 0, out.stderr
    assert out.stdout == alone.stdout and out.stdout.endswith("done\n")
    # the Fabric model at its validation sanity check, and the meta-device copy measure_flops runs
    assert [m["model"] for m in data["models"]] == ["GPT", "GPT"]
    assert _errors(data) == []
    assert data["models"][0]["framework"]["setting"] == "precision='bf16-mixed'"


def test_a_bug_only_lightnings_bf16_true_meets_is_found_under_fabrics_precision(tmp_path: Path) -> None:
    """Fabric's bf16-true converts the norms too: a LayerNorm run on x.float() crashes; the audit
    of the Fabric script finds it (lightning:bf16-true), before the script fails on it."""
    out, data = _run(tmp_path, SCRIPTS / "litgpt_pretrain.py", "--precision", "bf16-true", "--upcast-norm")
    assert out.returncode == 1
    assert _errors(data) == [("GPT", "CW101")], out.stderr  # transformer.ln_f's weight, cast by Fabric
    assert data["models"][0]["runs"][0]["policy"] == "lightning:bf16-true,converted=on"
    assert out.stderr.index("error CW") < out.stderr.index("Traceback")


def test_castwise_bf16_true_on_a_lightning_script_says_it_is_not_lightnings(tmp_path: Path) -> None:
    """`--policy bf16-true` is castwise's (norms in f32): the same bug audits clean under it, and
    castwise says how Lightning's differs and which string means Lightning's."""
    script = SCRIPTS / "litgpt_pretrain.py"
    args = ("--precision", "bf16-true", "--upcast-norm")
    ours, data = _run(tmp_path, script, *args, options=("--policy", "bf16-true", "--mode", "eval"))
    assert _errors(data) == []  # castwise's bf16-true keeps the norm f32: what Lightning runs is not checked
    (note,) = data["notes"]
    assert "lightning:bf16-true" in note and "norms=none" in note and "default_dtype=bf16" in note
    assert f"castwise run: note: {note}" in ours.stderr
    theirs, data = _run(tmp_path, script, *args, options=("--policy", "lightning:bf16-true", "--mode", "eval"))
    assert "notes" not in data and "note:" not in theirs.stderr
    assert _errors(data) != []


@pytest.mark.parametrize("how", ["env", "argument"])
def test_accelerates_precision_is_the_policy_the_audit_runs(tmp_path: Path, how: str) -> None:
    script = SCRIPTS / "accelerate_train.py"
    args = ("--mixed_precision", "bf16") if how == "argument" else ()
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"} if how == "env" else {}
    alone = _alone(tmp_path, script, *args, **env)
    out, data = _run(tmp_path, script, *args, **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == alone.stdout and "(bf16)" in out.stdout
    (model,) = data["models"]
    assert {r["policy"] for r in model["runs"]} == {"bf16-mixed"}
    assert model["framework"]["setting"] == "mixed_precision='bf16'"
    assert "= Accelerate's mixed_precision='bf16'" in " ".join(out.stderr.split())


def test_accelerates_autocast_follows_the_device_and_policy_given(tmp_path: Path) -> None:
    """Accelerate's forward autocasts on the device the script runs on (cpu): the audit for cuda
    runs its bf16 autocast there, and --policy replaces it (no bf16 left under 32-true)."""
    script = SCRIPTS / "accelerate_train.py"
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    _, cuda = _run(tmp_path, script, options=("--device", "cuda", "--mode", "train"), **env)
    (model,) = cuda["models"]
    assert model["runs"][0]["device"] == "cuda" and model["runs"][0]["policy"] == "bf16-mixed"
    assert "bfloat16" in model["summary"]["activation_bytes_by_dtype"]
    out, f32 = _run(tmp_path, script, options=("--policy", "32-true", "--mode", "train"), **env)
    (model,) = f32["models"]
    assert model["runs"][0]["policy"] == "32-true"
    assert set(model["summary"]["activation_bytes_by_dtype"]) == {"float32"}
    assert model["framework"]["replaced_by"] == "32-true"
    assert "32-true given in place of Accelerate's mixed_precision='bf16'" in " ".join(out.stderr.split())


def test_accelerates_fp16_on_cpu_is_said_to_run_without_autocast(tmp_path: Path) -> None:
    """Accelerate turns native AMP off for fp16 on the CPU: the model runs in f32 there, which the
    report says (also for --device cuda, where the same script would autocast), with the string
    that audits it as on a GPU."""
    script = SCRIPTS / "accelerate_train.py"
    args = ("--mixed_precision", "fp16")
    out, data = _run(tmp_path, script, *args, options=("--device", "cuda", "--mode", "train"))
    assert out.returncode == 0, out.stderr
    (model,) = data["models"]
    assert model["runs"][0]["policy"] is None and model["framework"]["policy"] is None
    title = " ".join(out.stderr.split())
    assert "policy none, as the script runs it: Accelerate's mixed_precision='fp16' has no autocast on cpu" in title
    assert "--policy accelerate:fp16 audits it as on a GPU" in title
    _, data = _run(tmp_path, script, *args, options=("--device", "cuda", "--mode", "train", "-p", "accelerate:fp16"))
    (model,) = data["models"]
    assert model["runs"][0]["policy"] == "16-mixed"
    assert "float16" in model["summary"]["activation_bytes_by_dtype"]


# -- in process: what castwise reads of a Fabric model, and Lightning's preset names


def test_a_fabric_module_is_read_as_its_users_module_and_precision() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    model = nn.Linear(4, 4)
    wrapped = fabric.setup_module(model)
    seen = framed(wrapped)
    assert seen is not None and seen.user is model and seen.wrapper is wrapped
    # true: the inputs are cast by the preset itself; the module is as Fabric converted it at setup
    assert seen.policy == "lightning:bf16-true,converted=on"
    assert seen.audited(None) is model and seen.audited("32-true") is model
    assert seen.describe(None) == " = Lightning Fabric's precision='bf16-true'"
    # a mixed --policy casts no weight: it cannot undo the conversion Fabric made at setup, and says so
    assert "weights stay as Lightning Fabric converted them" in seen.describe("bf16-mixed")
    assert framed(model) is None


def test_fabrics_backward_guard_is_satisfied_only_while_the_audit_runs() -> None:
    from lightning.fabric import wrappers

    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    wrapped = fabric.setup_module(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match=r"fabric\.backward"):
        wrapped(torch.randn(2, 4)).float().sum().backward()
    with framework_backward(framed(wrapped)):
        wrapped(torch.randn(2, 4)).float().sum().backward()  # as fabric.backward runs it
    assert wrappers._in_fabric_backward is False


def test_a_bare_preset_lightning_also_has_names_where_castwise_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    note = preset_note("bf16-true,fastpath=off")
    assert note is not None and "--policy lightning:bf16-true" in note and "norms=none" in note
    assert "default_dtype=f16" in (preset_note("16-true") or "")
    assert preset_note("bf16-mixed") is None  # the same meaning in both
    assert preset_note("lightning:bf16-true") is None
    assert preset_note("fp16") is None  # not a Lightning string
    for name in ("lightning", "lightning_fabric", "pytorch_lightning"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert preset_note("bf16-true") is None  # a script that does not run Lightning


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_a_lightning_trainer_fit_is_audited_in_the_trainers_precision(tmp_path: Path, precision: str) -> None:
    """The Trainer calls training_step itself (no wrapper around the module): the audit finds the
    Trainer on the stack and runs the module under lightning:<precision>, named in the report."""
    script = SCRIPTS / "lightning_trainer.py"
    alone = _alone(tmp_path, script, "--precision", precision)
    out, data = _run(tmp_path, script, "--precision", precision)
    assert out.returncode == 0 and out.stdout == alone.stdout, out.stderr[-2000:]
    (model,) = data["models"]
    assert model["model"] == "SequenceClassifier" and _errors(data) == []
    assert model["framework"]["name"] == "Lightning Trainer"
    # bf16-true: Lightning converted the module at setup, so the audit runs its tensors as they are
    policy = f"lightning:{precision}" + (",converted=on" if precision == "bf16-true" else "")
    assert model["framework"]["policy"] == policy
    assert {r["policy"] for r in model["runs"]} == {str(Policy.parse(policy))}
    assert f"= Lightning Trainer's precision='{precision}'" in " ".join(out.stderr.split())
    if precision == "bf16-true":
        given, data = _run(tmp_path, script, "--precision", precision, options=("--policy", "32-true"))
        assert f"given in place of Lightning Trainer's precision='{precision}'" in " ".join(given.stderr.split())


def test_the_lightning_trainers_planted_bug_is_found_under_its_precision(tmp_path: Path) -> None:
    out, data = _run(tmp_path, SCRIPTS / "lightning_trainer.py", "--batch-first")
    assert _errors(data) == [("SequenceClassifier", "CW103")], out.stderr[-2000:]
    assert data["models"][0]["framework"]["setting"] == "precision='bf16-mixed'"


def test_a_head_made_after_lightnings_conversion_is_named_by_the_conversion_order(tmp_path: Path) -> None:
    """issue 39: a bf16-true fit whose head is made in on_fit_start (after the strategy's
    convert_module): the real fit crashes; castwise names Lightning's order, not a hand cast."""
    script = SCRIPTS / "lightning_trainer.py"
    args = ("--precision", "bf16-true", "--late-head")
    alone = _alone(tmp_path, script, *args)
    assert alone.returncode != 0 and "same dtype" in alone.stderr  # the truth: the real fit fails
    out, data = _run(tmp_path, script, *args)
    assert _errors(data) == [("SequenceClassifier", "CW118")], out.stderr[-3000:]
    (f,) = [f for f in data["models"][0]["findings"] if f["code"] == "CW118"]
    assert f["module"] == "head" and "convert_module" in f["message"] and "made after" in f["message"]
    assert "by hand" not in f["message"] and "configure_model()" in f["fix"] and ".to(torch" not in f["fix"]
    assert out.stderr.index("error CW118") < out.stderr.index("Traceback")


def _steps(stdout: str) -> list[str]:
    """The losses the run prints (its other lines carry timestamps and run times)."""
    return [line for line in stdout.splitlines() if line.startswith(("{'loss'", "train loss"))]


def test_a_transformers_trainer_is_named_with_the_accelerate_precision_it_runs(tmp_path: Path) -> None:
    """transformers' Trainer runs TrainingArguments(bf16=True) through Accelerate's autocast: the
    policy is Accelerate's, the report names the Trainer's own setting."""
    script = SCRIPTS / "hf_trainer_train.py"
    alone = _alone(tmp_path, script, "--bf16")
    out, data = _run(tmp_path, script, "--bf16")
    assert out.returncode == 0 and _steps(out.stdout) == _steps(alone.stdout), out.stderr[-2000:]
    (model,) = data["models"]
    assert model["model"] == "LlamaForCausalLM" and _errors(data) == []
    assert model["framework"]["name"] == "transformers Trainer"
    assert model["framework"]["setting"] == "TrainingArguments(bf16=True) through Accelerate's mixed_precision='bf16'"
    assert model["framework"]["policy"] == "accelerate:bf16"
    assert "= transformers Trainer's TrainingArguments(bf16=True)" in " ".join(out.stderr.split())
    # without bf16 the Trainer adds no precision: the model runs as it is, and nothing is named
    out, data = _run(tmp_path, script)
    assert "framework" not in data["models"][0], data["models"][0].get("framework")
