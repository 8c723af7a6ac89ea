"""The package's surface: light import, every public name resolvable, the CLI entry points."""

from __future__ import annotations

import subprocess
import sys

import castwise


def test_import_castwise_does_not_import_torch() -> None:
    code = "import sys, castwise; castwise.explain; castwise.lint_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_public_name_resolves() -> None:
    assert sorted(castwise.__all__) == castwise.__all__
    for name in castwise.__all__:
        assert getattr(castwise, name) is not None
    assert issubclass(castwise.PolicyError, castwise.CastwiseError)
    assert issubclass(castwise.ApplyError, castwise.CastwiseError)


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        castwise.nonexistent  # noqa: B018
    except AttributeError as exc:
        assert "nonexistent" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_python_dash_m_and_help() -> None:
    p = subprocess.run([sys.executable, "-m", "castwise", "--help"], capture_output=True, text=True)
    assert p.returncode == 0
    for command in ("audit", "explain", "lint-config", "rules", "demo"):
        assert command in p.stdout


def test_usage_error_exits_2() -> None:
    p = subprocess.run([sys.executable, "-m", "castwise", "audit"], capture_output=True, text=True)
    assert p.returncode == 2
    p = subprocess.run(
        [sys.executable, "-m", "castwise", "audit", "no_such_module:build"], capture_output=True, text=True
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
