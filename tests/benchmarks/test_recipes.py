"""The recipe benchmark end to end on a tiny slice (2 models x 3 recipes, CPU), its scoring on a
known-good case and a planted one, and the outcome rule on hand-built scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from benchmarks.bench_recipes import main
from benchmarks.recipes.cases import RecipeCase, evaluate, outcome
from benchmarks.zoo.cases import quiet
from benchmarks.zoo.scoring import Score

RECIPES = "autocast-bf16,ckpt-nonreentrant,lora-bf16-base"


def test_a_tiny_slice_runs_end_to_end_and_scores_the_clean_recipes_ok(tmp_path: Path) -> None:
    out = tmp_path / "recipes.json"
    argv = ["--models", "llama,gpt2", "--recipes", RECIPES, "--devices", "cpu", "--faults-per-recipe", "0"]
    assert main([*argv, "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert len(results) == 6
    assert not [r for r in results if "harness_error" in r or "not_applicable" in r]
    for r in results:
        # these recipes train for real on CPU, and castwise says nothing against them
        assert r["real"] == {"train": {"status": "ok", "message": ""}, "eval": {"status": "ok", "message": ""}}, r
        assert list(r["halves"]) == ["cpu"]
        assert r["halves"]["cpu"]["outcome"] == "ok", r["halves"]["cpu"]
    summary = json.loads(out.read_text())["summary"]
    assert summary["by_device"] == {"cpu": {"ok": 6}}


def test_a_planted_fault_under_a_recipe_fails_for_real_and_is_found_at_its_module() -> None:
    quiet()
    # an f32 buffer left in a bf16 LoRA base: the real run fails in both modes
    record = evaluate(RecipeCase("llama", "lora-bf16-base", "buffer_left_fp32", 202), ("cpu",))
    planted = record["planted"]["module_name"]
    assert planted == "base_model.model.model.layers.1.mlp.act_fn"
    assert {m: r["status"] for m, r in record["real"].items()} == {"train": "dtype_error", "eval": "dtype_error"}
    s = record["halves"]["cpu"]["score"]
    assert s["detected"] and not s["missed"] and not s["false_alarm_modes"]
    assert s["origin_right"] and s["origin_seen"] == planted
    assert record["halves"]["cpu"]["outcome"] == "ok"


def _score(real: dict[str, str], **kw: object) -> Score:
    base: dict[str, object] = {
        "real_failed": "dtype_error" in real.values(),
        "detected": False,
        "missed": False,
        "false_alarm_modes": (),
        "origin_right": None,
        "origin_seen": None,
        "empty_slots": (),
        "crash": False,
        "incomplete": False,
        "incomplete_ok": False,
    }
    return Score(real=real, **{**base, **kw})  # type: ignore[arg-type]


def test_the_outcome_rule_per_device() -> None:
    ok = {"train": "ok", "eval": "ok"}
    failed = {"train": "dtype_error", "eval": "ok"}
    assert outcome(_score(ok), "cpu") == "ok"
    assert outcome(_score(ok, false_alarm_modes=("train",)), "cuda") == "false_error"
    assert outcome(_score(ok, crash=True, false_alarm_modes=("train",)), "cpu") == "crash"
    assert outcome(_score(failed, missed=True), "cpu") == "missed"
    # no CUDA truth here: a simulated-CUDA audit that says nothing where the CPU run fails is not a miss
    assert outcome(_score(failed, missed=True), "cuda") == "ok"
    assert outcome(_score(ok, incomplete=True), "cpu") == "incomplete"
    assert outcome(_score({"train": "other_error", "eval": "other_error"}), "cpu") == "unscored"
    # against a real CUDA run (--truth cuda) the simulated-CUDA half's misses count
    assert outcome(_score(failed, missed=True), "cuda", truth="cuda") == "missed"


def test_truth_cuda_without_a_gpu_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    # this machine has no CUDA device (CI runs on CPU): the option says so before running anything
    assert not torch.cuda.is_available()
    with pytest.raises(SystemExit) as exc:
        main(["--models", "gpt2", "--recipes", "autocast-bf16", "--truth", "cuda"])
    assert exc.value.code == 2
    assert "--truth cuda: no CUDA device" in capsys.readouterr().err
