"""`castwise run --device cuda` on a code base that picks its dtype when a module is imported
(nanochat's ``COMPUTE_DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32``):
the script's own modules import as on the simulated GPU, so the audit sees the GPU's dtype; the
script's body and every library still see this machine. Truth: the planted fault crashes the
real CPU run of the GPU's dtype (the same mm refusal as on CUDA), and the clean run prints what
it prints alone, the compute dtype aside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from castwise import devices
from castwise.integrations.imports import imported_as_on

REPO = Path(__file__).parent / "scripts" / "nanochat_repo"


def _run(
    tmp_path: Path, *options: str, planted: bool = False
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-B", "-m", "castwise", "run", "--json", str(report), *options, "base_train.py"]
    out = subprocess.run(
        [*cmd, *(["--planted"] if planted else [])],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    return out, json.loads(report.read_text()) if report.exists() else {}


def _errors(data: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["model"], f["code"]) for m in data["models"] for f in m["findings"] if f["severity"] == "error"]


def test_the_gpus_import_time_dtype_is_audited_and_its_planted_fault_found(tmp_path: Path) -> None:
    out, data = _run(tmp_path, "--device", "cuda", planted=True)
    assert _errors(data) and _errors(data)[0][0] == "GPT", out.stderr[-2000:]
    assert any("nanochat.common" in n and "sm 9.0" in n for n in data["notes"]), data.get("notes")
    # the truth: the script's own run in the GPU's dtype meets the fault for real (CPU's mm refuses as CUDA's)
    assert "same dtype" in out.stderr and out.returncode == 1
    # on this machine's own dtype (f32) the fault does not exist: nothing to find, nothing to note
    out, data = _run(tmp_path, planted=True)
    assert out.returncode == 0 and not _errors(data) and "notes" not in data, out.stderr[-2000:]


def test_the_script_is_otherwise_the_same_run(tmp_path: Path) -> None:
    alone = subprocess.run(
        [sys.executable, "-B", "base_train.py"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout.splitlines()
    out, data = _run(tmp_path, "--device", "cuda")
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and not _errors(data), out.stderr[-2000:]
    # the script's body saw this machine: the same device, no GPU
    assert lines[0] == alone[0] == "device cpu cuda available in the script False"
    assert len(lines) == len(alone)
    for mine, theirs in zip(lines[1:], alone[1:], strict=True):
        assert "torch.bfloat16" in mine and "torch.float32" in theirs  # only the import-time choice differs
        assert abs(float(mine.split()[-1]) - float(theirs.split()[-1])) < 0.02
    out, _ = _run(tmp_path, "--device", "cpu")
    assert out.stdout.splitlines() == alone  # no simulated GPU: nothing changes


def test_only_the_code_bases_own_modules_import_as_on_the_gpu(tmp_path: Path) -> None:
    own, lib = tmp_path / "own", tmp_path / "lib"
    for folder, name in ((own, "f7_own_mod"), (lib, "f7_lib_mod")):
        folder.mkdir()
        (folder / f"{name}.py").write_text("import torch\nAVAILABLE = torch.cuda.is_available()\n")
    host = torch.cuda.is_available()
    meta = list(sys.meta_path)
    sys.path[:0] = [str(own), str(lib)]
    try:
        with imported_as_on(devices.get("cuda"), str(own)) as seen:
            import f7_lib_mod  # type: ignore[import-not-found]
            import f7_own_mod  # type: ignore[import-not-found]

            assert torch.cuda.is_available() == host  # the caller's own code: this machine
        assert f7_own_mod.AVAILABLE is True and host == f7_lib_mod.AVAILABLE and seen == ["f7_own_mod"]
        assert sys.meta_path == meta and torch.cuda.is_available() == host
    finally:
        sys.path[:] = [p for p in sys.path if p not in (str(own), str(lib))]
        sys.modules.pop("f7_own_mod", None)
        sys.modules.pop("f7_lib_mod", None)
