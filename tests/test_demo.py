"""`castwise demo` where an optional library is installed but fails to import (open_clip with a
torchvision built for another torch): the stories that need it are skipped, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"

# run in a fresh interpreter: story 1 (open_clip) and the numerics story's check (transformers)
STORY_1 = """\
import sys
from castwise.demo import _Out, _model_story
from castwise.stories import STORIES, unavailable

ok = _model_story(_Out(sys.stdout, 100), STORIES[0])
print("result", ok, unavailable("open_clip") is not None)
"""


def _broken_package(root: Path, name: str, raise_line: str) -> None:
    """A real package named ``name``, first on sys.path, whose import raises."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(raise_line + "\n", encoding="utf-8")


@pytest.mark.parametrize(
    ("raise_line", "kind"),
    [
        ('raise RuntimeError("operator torchvision::nms does not exist")', "RuntimeError"),
        ("raise ImportError(\"cannot import name 'InterpolationMode' from torchvision.transforms\")", "ImportError"),
    ],
)
def test_a_library_that_fails_to_import_skips_its_story_saying_why(tmp_path: Path, raise_line: str, kind: str) -> None:
    _broken_package(tmp_path, "open_clip", raise_line)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    p = subprocess.run([sys.executable, "-c", STORY_1], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert "skipped" in p.stdout and f"open_clip is installed but fails to import ({kind}:" in p.stdout
    assert p.stdout.strip().splitlines()[-1] == "result None True"  # not run: not counted as fixed


def test_demo_skips_the_numerics_story_when_transformers_fails_to_import(tmp_path: Path) -> None:
    _broken_package(tmp_path, "transformers", 'raise RuntimeError("Failed to import transformers.models")')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    code = (
        "import sys\nfrom castwise.demo import _Out, _numerics_story, _quiet_libraries\n"
        "with _quiet_libraries():\n    print('result', _numerics_story(_Out(sys.stdout, 100)))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "transformers is installed but fails to import (RuntimeError:" in p.stdout
    assert p.stdout.strip().splitlines()[-1] == "result None"
