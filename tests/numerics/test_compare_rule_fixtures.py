"""Each tests/rules/fixtures/CW32x/CW33x fixture triggers its rule through compare or tune."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

import castwise
from castwise import rules

FIXTURES = Path(__file__).parents[1] / "rules" / "fixtures"
NUMERICS_FIXTURES = sorted(p for p in FIXTURES.glob("CW3[23]*.py"))


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fixture_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_compare_and_tune_rule_has_a_fixture() -> None:
    codes = {code for code in rules.REGISTRY if code.startswith(("CW32", "CW33"))}
    assert codes == {p.name[:5] for p in NUMERICS_FIXTURES}


@pytest.mark.parametrize("path", NUMERICS_FIXTURES, ids=lambda p: p.stem)
def test_fixture_triggers_its_rule(path: Path) -> None:
    fixture = _load(path)
    model, inputs = fixture.build()
    spec, expect = fixture.NUMERICS, fixture.EXPECT
    if spec["call"] == "compare":
        if spec.get("compile"):  # compiled against eager (CW322): the model as torch.compile returns it
            model = torch.compile(model)
        findings = castwise.compare(
            model, inputs, policy=spec["policy"], reference=spec.get("reference", "32-true")
        ).findings
    else:
        tuned = castwise.tune(model, inputs, policy=spec["policy"], budget=spec["budget"])
        findings = tuned.findings
        if "islands" in expect:
            assert list(tuned.islands) == expect["islands"]
    assert findings and findings[0].code == expect["code"], [f.code for f in findings]
    assert findings[0].module == expect["module"]
