"""`castwise run` under a real torchrun (two gloo processes): each distinct rank program audited
once, rank 0 printing one report for all ranks with each finding naming its ranks, the other
ranks printing nothing of castwise's (castwise.integrations.ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_two_stages.py"


def _torchrun(tmp_path: Path, case: str) -> tuple[int, dict[int, str], dict[int, str], dict]:  # type: ignore[type-arg]
    """Run the script under torchrun; (exit code, stderr and stdout per rank, rank 0's JSON)."""
    logs, report = tmp_path / "logs", tmp_path / "report.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    # the c10d rendezvous on port 0: the agent binds a free port itself and hands it to the workers
    # (MASTER_PORT), so no port is picked here and released for another process to take
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", "localhost:0", "--redirects", "3", "--log-dir", str(logs)]
    command += ["-m", "castwise", "run", "--mode", "eval", "--json", str(report), str(SCRIPT), case]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    err = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    std = {int(p.parent.name): p.read_text() for p in logs.rglob("stdout.log")}
    assert set(err) == {0, 1}, out.stderr
    return out.returncode, err, std, json.loads(report.read_text()) if report.exists() else {}


def test_a_fault_of_rank_1s_stage_alone_is_reported_by_rank_0_naming_rank_1(tmp_path: Path) -> None:
    code, err, _std, payload = _torchrun(tmp_path, "fault")
    assert code != 0  # rank 1's head raises for real: mat1 and mat2 must have the same dtype
    assert "mat1 and mat2 must have the same dtype" in err[1]
    assert "castwise" not in err[1]
    assert "2 distinct rank programs over 2 ranks" in err[0]
    [model] = payload["models"]
    [finding] = [f for f in model["findings"] if f["severity"] == "error"]
    assert finding["module"] == "2" and finding["ranks"] == [1] and finding["message"].endswith("[rank 1]")
    assert [p["ranks"] for p in model["programs"]] == [[0], [1]]


@pytest.mark.parametrize("case", ["clean", "replicas"])
def test_clean_programs_stay_clean_and_replicas_are_audited_once(tmp_path: Path, case: str) -> None:
    code, err, std, payload = _torchrun(tmp_path, case)
    assert code == 0, err
    assert "castwise" not in err[1] and "step 1" in std[1]
    [model] = payload["models"]
    assert not [f for f in model["findings"] if f["severity"] == "error"], model["findings"]
    programs = [p["ranks"] for p in model["programs"]]
    assert programs == ([[0, 1]] if case == "replicas" else [[0], [1]])
    if case == "replicas":
        assert "the same program on ranks 0-1 of 2" in err[0]
