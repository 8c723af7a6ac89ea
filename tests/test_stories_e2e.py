"""The five stories as users live them, against the real libraries: the real failure, the
diagnosis, the fix applied, the run passing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import castwise
from castwise.stories import SIMPLETUNER_ENV, STORIES, Story

MODEL_STORIES = {story.number: story for story in STORIES}


@pytest.fixture(scope="module", params=sorted(MODEL_STORIES), ids=lambda n: f"story{n}")
def story(request: pytest.FixtureRequest) -> Story:
    return MODEL_STORIES[request.param]


def test_story_fails_diagnoses_and_is_fixed(story: Story) -> None:
    model, inputs = story.build()
    # 1. the real failure (a CUDA story passes on CPU: CPU autocast keeps layer_norm in bf16)
    if story.device == "cpu":
        with pytest.raises((RuntimeError, ValueError)):
            story.run_real(model, inputs)
    else:
        story.run_real(model, inputs)
    # 2. the diagnosis, on fake tensors, for the device the user deploys on
    report = castwise.audit(model, inputs, policy=story.policy, device=story.device, mode="both")
    assert not report.ok
    errors = [f for f in report.errors if f.module == story.module]
    assert errors, [(f.code, f.module) for f in report.errors]
    assert story.mode in errors[0].modes
    if story.origin is not None:
        assert errors[0].origin is not None and errors[0].origin.module == story.origin
    # 3. the fix keeps the user's precision and passes a re-audit on the target device
    policy = report.suggested_policy
    assert policy is not None and policy.compute_dtype == story.compute
    assert castwise.audit(model, inputs, policy=policy, device=story.device, mode="both").ok
    # 4. and the real run passes under it
    castwise.apply(model, policy)
    story.run_real(model, inputs)


def test_story3_fails_only_in_eval() -> None:
    story = MODEL_STORIES[3]
    model, inputs = story.build()
    report = castwise.audit(model, inputs, policy="bf16-mixed", mode="both")
    modes = {m for f in report.errors for m in f.modes}
    assert modes == {"eval"}
    assert any(f.code == "CW121" for f in report.findings)


def test_story5_config_lint(tmp_path: Path) -> None:
    path = tmp_path / "config.env"
    path.write_text(SIMPLETUNER_ENV)
    report = castwise.lint_config(str(path))
    assert not report.ok
    settings = report.errors[0].settings
    assert "MIXED_PRECISION" in settings and "--gradient_precision" in settings


def test_demo_runs_all_six_stories_and_exits_0() -> None:
    p = subprocess.run([sys.executable, "-m", "castwise", "demo"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for n in range(1, 7):
        assert f"Story {n}." in p.stdout
    assert "6/6 stories diagnosed and fixed" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr
    assert torch.backends.mha.get_fastpath_enabled()
