"""A model that raises in one of the numerics' runs (its float32 reference, or the target) gets the
audit's finding (module, origin, fix) and castwise's exit code, never the model's raw traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import castwise
from castwise.cli.numerics import numerics_command
from castwise.numerics.tune import tune


class HandMadeTable(nn.Module):
    """Multiplies its f32 activations by a bf16 table made by hand in forward (a dtype bug of the
    model's own: every run of it raises, the float32 reference included)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.ones(8, 8).to(torch.bfloat16)
        return self.proj(x) @ table


class CastByHand(nn.Module):
    """A parameter cast to bf16 by hand: the model's own (f32) run raises; under a bf16 policy
    it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.ones(8, 8).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ self.table


def _model(inner: type[nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), inner(), nn.Linear(8, 4)), torch.randn(2, 8)


def build() -> tuple[nn.Module, torch.Tensor]:
    """The CLI's target (this file:build)."""
    return _model(HandMadeTable)


def _the_audits(findings: list[castwise.Finding]) -> castwise.Finding:
    errors = [f for f in findings if f.level == "error"]
    assert errors, findings
    f = errors[0]
    assert f.code.startswith("CW1") and f.module == "1" and f.fix, f
    return f


def test_compare_of_a_model_whose_reference_run_raises_gives_the_audits_finding() -> None:
    model, x = _model(HandMadeTable)
    report = castwise.compare(model, x, policy="bf16-mixed")
    f = _the_audits(report.findings)
    assert f.origin is not None and f.origin.module == "1"  # where the bf16 table was made
    assert "reference" in f.message and "32-true" in f.message
    assert not report.ok and report.runs[0].status == "error"
    assert report.summary["loss_reference"] is None
    assert "castwise numerics --compare" in str(report)
    json.loads(report.to_json())


def test_tune_of_a_model_whose_reference_run_raises_gives_the_audits_finding() -> None:
    model, x = _model(HandMadeTable)
    tuned = tune(model, x, policy="bf16-mixed", budget=1e-2)
    assert not tuned.ok
    _the_audits(tuned.findings)
    assert json.loads(tuned.to_json())["findings"][0]["code"].startswith("CW1")
    assert "CW1" in str(tuned)


@pytest.mark.parametrize("which", ["forecast", "locate_nonfinite"])
def test_forecast_and_locate_of_a_model_that_raises_give_the_audits_finding(which: str) -> None:
    model, x = _model(CastByHand)
    report = getattr(castwise, which)(model, x)
    f = _the_audits(report.findings)
    assert "bf16" in f.message
    assert not report.ok
    # compare runs it: the reference makes the parameter f32, bf16-mixed computes under autocast
    assert castwise.compare(model, x, policy="bf16-mixed").summary["output_err"] is not None


@pytest.mark.parametrize(
    "args",
    [["--compare", "-p", "bf16-mixed"], ["--tune", "1e-2", "-p", "bf16-mixed"], ["--forecast", "f16"], ["--locate"]],
    ids=["compare", "tune", "forecast", "locate"],
)
def test_cli_on_a_model_that_raises_prints_the_finding_and_exits_1(args: list[str]) -> None:
    result = CliRunner().invoke(numerics_command, [f"{Path(__file__)}:build", *args])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) or result.exception is None, result.exception
    assert "Traceback" not in result.output and "error CW1" in result.output, result.output


def test_compare_against_eager_diagnoses_a_model_that_raises_in_its_float32_run() -> None:
    # bf16-true runs it (its table meets bf16 activations); the float32 run every module is
    # measured against does not: the audit's finding, never the traceback, and nothing compiled
    model, x = _model(HandMadeTable)
    report = castwise.compare(torch.compile(model), x, policy="bf16-true", reference="eager", mode="eval")
    f = _the_audits(report.findings)
    assert f.message.startswith("The reference run (32-true) raised here")
    assert report.summary["compiles"] == 0 and report.summary["first_divergent"] is None
    assert [r.status for r in report.runs] == ["incomplete", "incomplete"]
    assert "raised here" in str(report)
