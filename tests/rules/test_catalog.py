"""The diagnostic catalog is complete: every rule has a page, a valid category, an example
fixture, and the CLI lists and prints it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from castwise import rules
from castwise.categories import CATEGORIES

FIXTURES = Path(__file__).parent / "fixtures"
CODES = sorted(rules.REGISTRY)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # piped output: 100 columns
    return subprocess.run(
        [sys.executable, "-m", "castwise", *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )


def test_registry_is_not_empty_and_sorted() -> None:
    assert CODES, "the rule registry is empty"
    assert list(rules.REGISTRY) == CODES


@pytest.mark.parametrize("code", CODES)
def test_rule_page_is_complete(code: str) -> None:
    rule = rules.REGISTRY[code]
    for part in ("summary", "detects", "why", "example", "fix"):
        assert getattr(rule, part).strip(), f"{code}: empty {part}"
    assert "\n" not in rule.summary.strip(), f"{code}: summary must be one line"
    assert rule.severity in rules.SEVERITIES
    # category None is allowed only for failures that are not dtype root causes
    assert rule.category is None or rule.category in CATEGORIES, f"{code}: category {rule.category}"
    page = rule.page()
    for heading in ("What it detects", "Why it matters", "Example", "Fix"):
        assert heading in page
    assert rule.example.strip().splitlines()[0] in page


@pytest.mark.parametrize("code", CODES)
def test_rule_has_example_fixture(code: str) -> None:
    found = sorted(p.name for p in FIXTURES.glob(f"{code}_*") if p.is_file() and p.stat().st_size > 0)
    assert found, (
        f"{code} has no example fixture: add tests/rules/fixtures/{code}_<what>.<ext> "
        f"(a model or a config that triggers {rules.REGISTRY[code].name})"
    )


def test_fixtures_name_known_codes() -> None:
    """A fixture for a code that does not exist (typo, removed rule) is an error too."""
    strays = sorted(p.name for p in FIXTURES.glob("CW*") if p.name.split("_", 1)[0] not in rules.REGISTRY)
    assert not strays, f"fixtures for unknown codes: {strays}"


def test_cli_lists_every_rule() -> None:
    out = _cli("rules")
    assert out.returncode == 0, out.stderr
    # each rule's first line starts with its code; its summary may wrap onto indented lines
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.strip() and not line[0].isspace()]
    assert listed == CODES
    for code in CODES:
        assert rules.REGISTRY[code].name in out.stdout


def test_cli_prints_each_page() -> None:
    for code in CODES:
        out = _cli("rules", code.lower())
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == rules.REGISTRY[code].page().strip()


def test_cli_rule_by_name_and_unknown_code() -> None:
    first = rules.REGISTRY[CODES[0]]
    by_name = _cli("rules", first.name)
    assert by_name.returncode == 0 and by_name.stdout.startswith(first.code)
    bad = _cli("rules", "CW000")
    assert bad.returncode == 2
    assert "no rule 'CW000'" in bad.stderr and CODES[0] in bad.stderr
