"""Each CW3xx fixture triggers its own rule, on the module its EXPECT names."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from castwise.cli.numerics import numerics_command
from castwise.numerics.forecast import forecast
from castwise.numerics.locate import locate_nonfinite
from castwise.numerics.watch import watch
from castwise.report import Report

FIXTURES = Path(__file__).parents[1] / "rules" / "fixtures"
PATHS = sorted(p for p in FIXTURES.glob("CW3[01]*.py"))  # CW32x/CW33x: compare and tune


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"cw_fixture_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(fixture: Any) -> Report:
    how = fixture.NUMERICS
    model, inputs = fixture.build()
    if how["run"] == "locate":
        return locate_nonfinite(model, inputs, mode=how.get("mode", "train"))
    if how["run"] == "forecast":
        return forecast(model, inputs, target=how["target"], mode=how.get("mode", "train"))
    seen: list[Report] = []
    with watch(model, on_nonfinite=seen.append):
        for _ in range(how["steps"]):
            model(*inputs).sum().backward()
    return seen[0]


def test_every_numerics_code_has_a_fixture() -> None:
    from castwise.rules.numerics import RULES

    assert {p.name.split("_")[0] for p in PATHS} == {r.code for r in RULES}


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_fixture_triggers_its_rule(path: Path) -> None:
    fixture = _load(path)
    report = _report(fixture)
    hits = [f for f in report.findings if f.code == fixture.EXPECT["code"]]
    assert hits, report
    assert fixture.EXPECT["module"] in [f.module for f in hits]


@pytest.mark.parametrize(
    ("name", "args", "code"),
    [
        ("CW301_fp16_wo_overflow.py", ["--locate"], 1),
        ("CW302_log_of_zero.py", ["--locate", "--mode", "train"], 1),
        ("CW310_attention_scores_f16.py", ["--forecast", "f16"], 0),
    ],
)
def test_cli_runs_a_fixture_with_the_documented_exit_code(name: str, args: list[str], code: int) -> None:
    result = CliRunner().invoke(numerics_command, [f"{FIXTURES / name}:build", *args, "--json", "-"])
    assert result.exit_code == code, result.output
    import json

    payload = json.loads(result.stdout)
    assert payload["findings"][0]["code"] == name.split("_")[0]
    assert "numerics" in payload["summary"]


def test_cli_usage_errors_exit_2() -> None:
    runner = CliRunner()
    target = f"{FIXTURES / 'CW302_log_of_zero.py'}:build"
    assert runner.invoke(numerics_command, [target]).exit_code == 2
    assert runner.invoke(numerics_command, [target, "--locate", "--forecast", "f16"]).exit_code == 2
    bad = runner.invoke(numerics_command, [target, "--forecast", "int3"])
    assert bad.exit_code == 2 and "valid:" in bad.output
    assert runner.invoke(numerics_command, ["nowhere.py:build", "--locate"]).exit_code == 2
    assert torch.is_grad_enabled()


def test_config_json_target_too_large_is_shrunk_and_the_report_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": 12, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 32}
        )
    )
    monkeypatch.setenv("CASTWISE_NUMERICS_MAX_BYTES", "200000")  # room for about two of the twelve layers
    result = CliRunner().invoke(numerics_command, [str(config), "--forecast", "bf16", "--json", "-"])
    assert result.exit_code == 0, result.output
    built = json.loads(result.stdout)["summary"]["numerics"]["built"]
    assert built.startswith("shrunk config: num_hidden_layers 12 -> ") and "random weights" in built
    kept = int(built.split("num_hidden_layers 12 -> ")[1].split(",")[0])
    assert 1 <= kept < 12
