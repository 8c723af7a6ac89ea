"""castwise run on training scripts in the styles people run (tests/integrations/scripts: nanoGPT,
timm, Lightning, diffusers, open_clip; tiny, CPU): a clean run prints exactly what the script
prints alone, exits 0 and has no error or warning finding; the planted bug of each is found, with
its module, before the script fails on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


@dataclass(frozen=True)
class Case:
    script: str
    clean: tuple[str, ...]
    planted: tuple[str, ...]
    code: str  # the planted bug's finding
    module: str
    model: str  # the model it is found in (as castwise run names it)


CASES = [
    Case("nanogpt_train.py", (), ("--n_expert=2",), "CW107", "h.0.mlp", "GPT"),
    Case(
        "timm_train.py",
        ("--amp",),
        ("--model-dtype", "bfloat16", "--no-input-cast"),
        "CW105",
        "patch_embed.proj",
        "VisionTransformer",
    ),
    Case("lightning_trainer.py", (), ("--batch-first",), "CW103", "encoder.layers.0", "SequenceClassifier"),
    Case("diffusers_text_to_image.py", (), ("--half_unet",), "CW124", "", "UNet2DConditionModel"),
    Case("open_clip_main.py", (), ("--precision", "bf16", "--model-dtype", "bf16"), "CW101", "visual.ln_pre", "CLIP"),
]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore", **extra}


def _castwise(
    tmp_path: Path, script: str, *args: str, options: tuple[str, ...] = (), **env: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "castwise", "run", "--json", str(report), *options, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=tmp_path,
        check=False,
    )
    models = json.loads(report.read_text())["models"] if report.exists() else []
    return out, models


def _alarms(models: list[dict[str, object]]) -> list[tuple[object, object, object]]:
    return [
        (m["model"], f["code"], f["module"])
        for m in models
        for f in m["findings"]  # type: ignore[attr-defined]
        if f["severity"] in ("error", "warning")
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.script.removesuffix(".py"))
def test_a_clean_script_runs_as_alone_with_no_finding(tmp_path: Path, case: Case) -> None:
    alone = subprocess.run(
        [sys.executable, str(SCRIPTS / case.script), *case.clean],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        check=False,
    )
    assert alone.returncode == 0, alone.stderr
    watched, models = _castwise(tmp_path, case.script, *case.clean)
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout == alone.stdout
    assert case.model in [m["model"] for m in models]
    assert _alarms(models) == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.script.removesuffix(".py"))
def test_the_planted_bug_is_found_before_the_script_fails_on_it(tmp_path: Path, case: Case) -> None:
    watched, models = _castwise(tmp_path, case.script, *case.planted)
    assert watched.returncode == 1
    errors = [(m["model"], f["code"], f["module"]) for m in models for f in m["findings"] if f["severity"] == "error"]  # type: ignore[attr-defined]
    assert (case.model, case.code, case.module) in errors, watched.stderr
    # nothing else raised (CW121 only says which mode fails)
    assert [a for a in _alarms(models) if a[1] != "CW121"] == errors
    # the finding is printed before the traceback of the script's own failure
    assert watched.stderr.index(f"error {case.code}") < watched.stderr.index("Traceback")


def test_a_frozen_f16_vae_is_not_blamed_under_fp16(tmp_path: Path) -> None:
    """diffusers casts its frozen VAE and text encoder to f16 on purpose: under `--policy fp16`
    (f32 weights, f16 autocast, a GradScaler) they are not 'params cast by hand', and the f32
    UNet they feed is clean."""
    watched, models = _castwise(tmp_path, "diffusers_text_to_image.py", options=("--policy", "fp16"))
    assert watched.returncode == 0, watched.stderr
    assert {"Encoder", "CLIPTextModel", "UNet2DConditionModel"} <= {m["model"] for m in models}
    assert _alarms(models) == []


def test_without_a_grad_scaler_f16_params_are_not_an_unscale_error(tmp_path: Path) -> None:
    """The script's f16 autocast scales the loss only where it made a GradScaler: a `.half()`
    UNet trained with the scaler disabled never meets unscale_ (the run does not fail on it)."""
    script = (
        (SCRIPTS / "diffusers_text_to_image.py")
        .read_text()
        .replace('enabled=args.mixed_precision == "fp16"', "enabled=False")
    )
    (tmp_path / "no_scaler.py").write_text(script)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "castwise",
            "run",
            "--json",
            str(tmp_path / "r.json"),
            str(tmp_path / "no_scaler.py"),
            "--half_unet",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        check=False,
    )
    models = json.loads((tmp_path / "r.json").read_text())["models"]
    assert "CW124" not in {f["code"] for m in models for f in m["findings"]}
    unet = next(m for m in models if m["model"] == "UNet2DConditionModel")
    assert unet["runs"][0]["policy"] == "16-mixed,loss_scale=none,keep_in_fp32=off"
    assert out.returncode == 0, out.stderr


def test_a_loss_scaler_made_through_timm_is_seen(tmp_path: Path) -> None:
    """timm's NativeScaler makes a torch.amp.GradScaler: the f16 autocast audit scales the loss
    (and the f32 model trained under it has no finding)."""
    watched, models = _castwise(tmp_path, "timm_train.py", "--amp", "--amp-dtype", "float16")
    assert watched.returncode == 0, watched.stderr
    (vit,) = models
    assert vit["runs"][0]["policy"] == "16-mixed,keep_in_fp32=off"  # loss scaling: the scaler was seen
    assert _alarms(models) == []
