"""Human output reads well in 80- and 100-column terminals: golden outputs of audit reports,
lint-config's report and precision model, the rule catalog and a rule page.

Regenerate after an intended change with ``CASTWISE_UPDATE_GOLDEN=1 pytest tests/test_render_golden.py``
and review the diff.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

import castwise
from castwise.stories import STORIES

GOLDEN = Path(__file__).parent / "golden"
FIXTURES = Path(__file__).parent / "rules" / "fixtures"
LINT = Path(__file__).parent / "lint" / "fixtures"
WIDTHS = (80, 100)


def _fixture(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"golden_{name}", FIXTURES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _story3() -> castwise.Report:
    model, inputs = STORIES[2].build()
    return castwise.audit(model, inputs, policy="bf16-mixed", mode="both")


def _story2() -> castwise.Report:
    model, inputs = STORIES[1].build()
    return castwise.audit(model, inputs, mode="eval")


def _from_fixture(name: str, **audit: Any) -> castwise.Report:
    fixture = _fixture(name)
    model, inputs = fixture.build()
    return castwise.audit(model, inputs, **(audit or fixture.AUDIT))


CASES = {
    "audit_story3_both": _story3,
    "audit_story2_eval": _story2,
    "audit_cw104_cuda": lambda: _from_fixture("CW104_fp32_into_lowp_kernel"),
    "audit_clean": lambda: _from_fixture("CW103_encoder_fast_path", policy="bf16-mixed,fastpath=off", mode="eval"),
    "audit_cw902_incomplete": lambda: _from_fixture("CW902_data_dependent"),
    "audit_cw113_hand_cast": lambda: _from_fixture("CW113_module_cast_by_hand"),
}


@functools.cache
def _report(name: str) -> castwise.Report:
    return CASES[name]()  # each audit once, rendered at every width


def _lint(width: int) -> str:
    from castwise.lint import lint_config, render

    cwd = os.getcwd()
    os.chdir(LINT)  # the report shows paths as given: relative, the same on every machine
    try:
        return render(lint_config("simpletuner/story5.env"), width)
    finally:
        os.chdir(cwd)


def _rules(width: int) -> str:
    from castwise.cli.rules import listing

    return listing(width)


def _rule_page(width: int) -> str:
    from castwise.rules import get

    return get("CW104").page(width)


TEXTS = {"lint_story5": _lint, "rules_list": _rules, "rule_cw104": _rule_page}


def _check(name: str, width: int, text: str) -> None:
    text += "\n"
    path = GOLDEN / (f"{name}.txt" if width == 100 else f"{name}_{width}.txt")
    if os.environ.get("CASTWISE_UPDATE_GOLDEN"):
        path.write_text(text, encoding="utf-8")
    widest = max(len(line) for line in text.splitlines())
    assert widest <= width, f"a line is {widest} columns wide, over {width}"
    assert text == path.read_text(encoding="utf-8")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_audit_report_matches_golden(name: str, width: int) -> None:
    from castwise.report import render_report

    report = _report(name)
    if width == 100:
        assert str(report) == render_report(report, 100)  # str() is the 100-column rendering
    _check(name, width, render_report(report, width))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_text_matches_golden(name: str, width: int) -> None:
    _check(name, width, TEXTS[name](width))
