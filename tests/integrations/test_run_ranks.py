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

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "pipeline_two_stages.py"


def _launch(tmp_path: Path, *argv: str) -> tuple[int, dict[int, str], dict[int, str]]:
    """``torchrun --nproc-per-node 2 ARGV``: (exit code, stderr and stdout per rank)."""
    logs = tmp_path / "logs"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    # the c10d rendezvous on port 0: the agent binds a free port itself and hands it to the workers
    # (MASTER_PORT), so no port is picked here and released for another process to take
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", "localhost:0", "--redirects", "3", "--log-dir", str(logs), *argv]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    err = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    std = {int(p.parent.name): p.read_text() for p in logs.rglob("stdout.log")}
    assert set(err) == {0, 1}, out.stderr
    return out.returncode, err, std


def _torchrun(tmp_path: Path, case: str) -> tuple[int, dict[int, str], dict[int, str], dict]:  # type: ignore[type-arg]
    """``castwise run`` of the pipeline script under torchrun; also rank 0's JSON."""
    report = tmp_path / "report.json"
    argv = ("-m", "castwise", "run", "--mode", "eval", "--json", str(report), str(SCRIPT), case)
    code, err, std = _launch(tmp_path, *argv)
    return code, err, std, json.loads(report.read_text()) if report.exists() else {}


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
    assert [(r["mode"], r["status"]) for r in model["runs"]] == [("eval", "error")]  # the worst of the two


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


def test_the_lightning_callback_under_ddp_audits_each_ranks_replica_and_rank_0_alone_logs(tmp_path: Path) -> None:
    """Under DDP every rank's callback audits the replica it holds, once DDP has wrapped it; rank
    zero alone logs. Replicas that differ never get there: DDP's construction fails (next test)."""
    code, err, std = _launch(tmp_path, str(SCRIPTS / "lightning_ddp.py"))
    assert code == 0, err
    for rank in (0, 1):
        assert f"rank {rank} fit starts on DistributedDataParallel" in std[rank]
        assert f"rank {rank} audited: ok=True" in std[rank]
    assert "audited training_step under bf16-mixed: no dtype errors" in err[0]
    assert "castwise" not in err[1]


def test_ddp_replicas_that_differ_in_dtype_fail_at_ddps_construction(tmp_path: Path) -> None:
    """What makes the callbacks' replicas identical: DDP broadcasts rank 0's state into each rank's
    at construction; a rank whose layer is f32 where rank 0's is bf16 ends there (gloo: "Received
    data size doesn't match expected size"), before any fit hook runs."""
    code, err, std = _launch(tmp_path, str(SCRIPTS / "ddp_replicas_differ.py"))
    assert code != 0
    assert "built DDP" not in std[1]
    assert "Received data size doesn't match expected size" in err[1]
