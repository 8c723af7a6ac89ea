"""`castwise lint-config` as a user runs it: exit codes, JSON, one-line errors, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIX = Path(__file__).parent / "fixtures"


def castwise(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "castwise", "lint-config", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_story5_exit_1_and_json(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    p = castwise(FIX / "simpletuner" / "story5.env", "--json", out)
    assert p.returncode == 1, p.stderr
    assert "CW201" in p.stdout and "--gradient_precision" in p.stdout
    assert "precision model" in p.stdout
    report = json.loads(out.read_text())
    (f,) = report["findings"]
    assert f["severity"] == "error" and f["name"] == "low-precision-weights-fp32-gradients"
    assert f["settings"] == ["MIXED_PRECISION", "--base_model_precision", "--gradient_precision"]
    assert [loc.rsplit(":", 1)[1] for loc in f["locations"]] == ["4", "8", "9"]
    assert report["summary"]["precision"]["gradients"]["value"] == "float32"


def test_clean_exit_0_json_to_stdout() -> None:
    p = castwise(FIX / "lightning" / "cli_bf16.yaml", "--json", "-")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["findings"] == []
    assert report["summary"]["files"][0]["format"] == "lightning"


def test_two_files_together(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text('{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}')
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\nmixed_precision: fp16\n")
    p = castwise("acc.yaml", "ds.json", "--json", "-", cwd=tmp_path)
    assert p.returncode == 1
    (f,) = json.loads(p.stdout)["findings"]
    assert f["code"] == "CW203" and f["locations"] == ["acc.yaml:2", "ds.json:1"]


def test_warning_only_exits_0(tmp_path: Path) -> None:
    (tmp_path / "trainer.yaml").write_text("trainer:\n  precision: 16-true\n")
    p = castwise(tmp_path / "trainer.yaml")
    assert p.returncode == 0
    assert "warning CW206" in p.stdout


def test_unreadable_files_exit_2_with_one_line(tmp_path: Path) -> None:
    cases = {
        "broken.yaml": "trainer: [unclosed\n",
        "ds_config.json": '{"fp16": }',
        "config.toml": "= nope",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "garbage.yaml").write_bytes(bytes(range(256)) * 8)
    with (tmp_path / "huge.json").open("wb") as fh:
        fh.truncate(50 * 1024 * 1024)
    (tmp_path / "default_config.yaml").write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: gone.json\n"
    )
    for name in [*cases, "garbage.yaml", "huge.json", "default_config.yaml", "absent.env"]:
        p = castwise(tmp_path / name)
        assert p.returncode == 2, (name, p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("castwise: error: "), (name, p.stderr)
        assert "Traceback" not in p.stderr
        assert name.split(".")[0] in lines[0] or "gone.json" in lines[0]


def test_launch_script_of_another_project_exits_2_saying_what_castwise_reads(tmp_path: Path) -> None:
    from tests.lint.test_errors import OPEN_CLIP_LAUNCH

    (tmp_path / "train.sh").write_text(OPEN_CLIP_LAUNCH, encoding="utf-8")
    p = castwise(tmp_path / "train.sh")
    assert p.returncode == 2 and p.stdout == ""
    assert "sets none of SimpleTuner's config.env variables" in p.stderr and "castwise reads:" in p.stderr


def test_never_imports_torch() -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "castwise",
            "lint-config",
            str(FIX / "accelerate" / "deepspeed_ok" / "default_config.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if "|" in line]
    assert "castwise.lint" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_api_never_imports_torch() -> None:
    code = (
        "import sys, castwise\n"
        f"r = castwise.lint_config({str(FIX / 'simpletuner' / 'story5.env')!r})\n"
        "assert [f.code for f in r.findings] == ['CW201'], r.findings\n"
        "assert 'torch' not in sys.modules\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
