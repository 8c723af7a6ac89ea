"""The ranks' meeting of `castwise run` (castwise.integrations.ranks) in one process: four ranks on
one in-memory store, as torchrun's agent store serves them; the torchrun runs are in test_run_ranks."""

from __future__ import annotations

import threading

import torch.distributed as dist

from castwise.integrations.ranks import Meeting
from castwise.report import Finding, Report


def test_one_audit_per_program_rank_0_joins_them_and_names_a_rank_that_said_nothing() -> None:
    store = dist.HashStore()
    shown: list[tuple[str, Report]] = []
    ranks = [Meeting(lambda: store, r, 4, "castwise/run/0") for r in range(4)]
    ranks[0].on_report = lambda name, report: shown.append((name, report))
    for meeting in ranks:
        meeting.start()
    audited: list[str] = []

    def audit(program: str, errors: bool) -> Report:
        audited.append(program)
        findings = [Finding(code="CW113", message="head kept in f32", module="2")] if errors else []
        return Report(findings=findings, title=f"castwise audit of {program}")

    ranks[2].finish()  # rank 2's script ran no model
    ranks[0].audit("Stage", "stage 0", lambda: audit("stage 0", False))
    workers = [
        threading.Thread(target=ranks[r].audit, args=("Stage", "stage 1", lambda: audit("stage 1", True)))
        for r in (1, 3)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for r in (1, 3):
        ranks[r].finish()
    ranks[0].finish()
    assert sorted(audited) == ["stage 0", "stage 1"]  # ranks 1 and 3 run one program: audited once
    [(name, report)] = shown
    assert name == "Stage"
    assert report.title == "castwise audit of stage 0 - 2 distinct rank programs over 4 ranks; rank 2 reported nothing"
    [finding] = report.findings
    assert finding.message == "head kept in f32 [ranks 1, 3]" and dict(finding.details)["ranks"] == [1, 3]
    assert [p["ranks"] for p in report.extra["programs"]] == [[0], [1, 3]]
