"""`castwise numerics TARGET --tune BUDGET`: the human text, the JSON and the HTML page of a tune run,
and its exit code (a Tuned is not a Report)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from castwise.cli.numerics import numerics_command

FIXTURE = Path(__file__).parents[1] / "rules" / "fixtures" / "CW331_island_for_cancellation.py"


def test_tune_prints_the_islands_writes_json_and_html_and_exits_0(tmp_path: Path) -> None:
    page, report = tmp_path / "tune.html", tmp_path / "tune.json"
    args = [f"{FIXTURE}:build", "--tune", "1e-2", "--policy", "16-true", "--json", str(report), "--html", str(page)]
    result = CliRunner().invoke(numerics_command, args)
    assert result.exit_code == 0, result.output
    assert "castwise numerics --tune" in result.output and "Traceback" not in result.output
    data = json.loads(report.read_text(encoding="utf-8"))
    assert data["met"] is True and data["policy"].startswith("16-true")
    assert [f["code"] for f in data["findings"]] == ["CW331"]
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_tune_json_on_stdout_is_json_only() -> None:
    args = [f"{FIXTURE}:build", "--tune", "1e-2", "-p", "16-true", "--json", "-"]
    result = CliRunner().invoke(numerics_command, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["budget"] == 1e-2


def test_tune_of_a_config_json_says_how_the_model_was_built(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64, "n_positions": 16})
    )
    result = CliRunner().invoke(numerics_command, [str(config), "--tune", "1", "-p", "bf16-mixed", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert "random weights" in json.loads(result.stdout)["summary"]["numerics"]["built"]


def test_json_on_stdout_stays_json_when_the_builder_prints(tmp_path: Path) -> None:
    from tests.cli.test_audit import CHATTY, run_cli

    (tmp_path / "chatty.py").write_text(CHATTY, encoding="utf-8")
    p = run_cli("numerics", tmp_path / "chatty.py:build", "--forecast", "f16", "--json", "-")
    assert p.returncode == 0, p.stderr
    assert isinstance(json.loads(p.stdout)["findings"], list)
    assert "number of parameters: 0.00M" in p.stderr and "forward (2, 8)" in p.stderr
