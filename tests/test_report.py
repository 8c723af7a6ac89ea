"""Findings and reports as values: severity resolution, JSON shape, ordering."""

from __future__ import annotations

import json

import pytest

from castwise.report import Finding, Origin, Report, Run


def test_severity_defaults_to_the_rules_and_is_visible_in_python() -> None:
    f = Finding("CW101", "msg", module="visual.ln_pre")
    assert f.severity == "error" == f.level
    assert Finding("CW120", "msg").severity == "warning"
    assert Finding("CW101", "msg", severity="warning").severity == "warning"


def test_bad_severity_and_unknown_code_are_refused() -> None:
    with pytest.raises(ValueError, match="valid: error, info, warning"):
        Finding("CW101", "msg", severity="fatal")
    with pytest.raises(Exception, match="CW999"):
        Finding("CW999", "msg")


def test_json_shape_and_ok() -> None:
    report = Report(
        findings=[
            Finding("CW120", "w"),
            Finding(
                "CW103",
                "e",
                module="encoder.layers.0",
                op="aten.x",
                origin=Origin("proj", "aten.addmm", "bf16[40, 32]"),
                modes=("eval",),
            ),
        ],
        runs=[Run("eval", "cpu", "bf16-mixed", "error")],
    )
    d = json.loads(report.to_json())
    assert not report.ok
    assert [f["code"] for f in d["findings"]] == ["CW103", "CW120"]  # errors first
    first = d["findings"][0]
    assert first["origin"] == {"module": "proj", "op": "aten.addmm", "tensor": "bf16[40, 32]"}
    assert first["category"] == "FASTPATH_BYPASSES_AUTOCAST" and first["name"] == "fast-path-ignores-autocast"
    assert first["modes"] == ["eval"] and first["fix"]
    assert d["runs"] == [{"mode": "eval", "device": "cpu", "policy": "bf16-mixed", "status": "error"}]
    assert d["suggested_policy"] is None
