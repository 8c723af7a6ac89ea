"""Pipeline and expert parallel audited as their rank programs (issue 37): one audit per distinct
program, found at the right module, ranks and collective (CW174 send/recv, CW175 collectives);
their look-alike controls clean; the real gloo runs of the same plans fail where the audit says."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.modules import module as module_mod

import castwise
from castwise.distributed.programs import RankPrograms
from castwise.errors import AuditError
from tests.distributed._group import fake_process_group
from tests.distributed._scale_cases import BF16, CASES, F32, Stage, _stages, found, programs, real_outcome


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_planted_faults_are_found_at_their_module_ranks_and_collective_and_controls_stay_clean(case) -> None:  # type: ignore[no-untyped-def]
    with fake_process_group(case.world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = castwise.audit(programs(case), case.inputs(), mode="train")
    assert found(report) == set(case.expect), [f.message for f in report.findings]
    assert report.ok is not case.planted


def test_one_audit_per_distinct_program_and_the_title_names_the_whole_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(16):
        mesh = init_device_mesh("cpu", (2, 4, 2), mesh_dim_names=("dp", "pp", "tp"))
        # stage 0 in bf16, stages 1-3 the same f32 program receiving and returning bf16
        make = _stages((BF16, F32, F32, F32), outs=(None, BF16, BF16, BF16), ins=(BF16,) * 4)
        stages = [make(i, mesh.get_group("pp")) for i in range(4)]
        report = castwise.audit(RankPrograms(tuple(stages), "pp", mesh), torch.randn(4, 16, dtype=BF16), mode="eval")
    assert "DP2 x PP4 x TP2 over 16 ranks (dp=2, pp=4, tp=2)" in report.title
    assert not report.findings, [f.message for f in report.findings]
    assert [p["pp"] for p in report.extra["programs"]] == [[0], [1, 2, 3]]
    assert report.extra["programs"][0]["first_ranks"] == [0, 1, 8, 9]
    assert [(p["send"], p["recv"]) for p in report.extra["p2p"]] == [("bf16[4, 16]", "bf16[4, 16]")] * 3
    assert not module_mod._global_forward_pre_hooks and not module_mod._global_forward_hooks


def test_experts_sharded_over_ep_are_read_as_the_ep_ranks_programs_from_the_model_itself() -> None:
    """No RankPrograms: the experts' DTensor weights sharded on dim 0 over the "ep" mesh dim make
    the model an EP plan, audited as its ranks' program (local experts, the style's all-to-alls)."""
    case = next(c for c in CASES if c.name.startswith("ep dtensor"))
    with fake_process_group(case.world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = programs(case)
        before = _held(model)
        report = castwise.audit(model, case.inputs(), mode="eval")
        after = _held(model)
    assert report.title.startswith("castwise audit of EP4 over 4 ranks (ep=4)")
    assert [p["ep"] for p in report.extra["programs"]] == [[0, 1, 2, 3]]
    [finding] = report.errors
    assert "The all-to-all in `experts` (torch.distributed.all_to_all_single)" in finding.message
    assert finding.message.endswith("[ep=0,1,2,3: ranks 0-3]")
    assert before == after and before["experts.w1"] == ("DTensor", torch.bfloat16, (2, 16, 8))


def _held(model: torch.nn.Module) -> dict[str, tuple[str, torch.dtype, tuple[int, ...]]]:
    """Each parameter's class, dtype and local shape (a DTensor's shard on this rank)."""
    local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in model.named_parameters()}
    return {n: (type(p).__name__, p.dtype, tuple(local[n].shape)) for n, p in model.named_parameters()}


def test_the_programs_themselves_are_left_as_they_were() -> None:
    case = next(c for c in CASES if c.name.startswith("ep: rank 3"))
    with fake_process_group(case.world):
        made = programs(case)
        before = [{n: (p.dtype, p.shape) for n, p in m.named_parameters()} for m in made.programs]
        castwise.audit(made, case.inputs(), mode="train")
        after = [{n: (p.dtype, p.shape) for n, p in m.named_parameters()} for m in made.programs]
    assert before == after


def test_bad_programs_are_refused_with_what_is_valid() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
        two = (Stage(0, 1, F32), Stage(1, 1, F32))
        with pytest.raises(AuditError, match=r"2 programs for the mesh dim pp=4"):
            castwise.audit(RankPrograms(two, "pp", mesh), torch.randn(4, 16))
        with pytest.raises(AuditError, match=r"no dim 'ep'; its dims are \['pp'\]"):
            castwise.audit(RankPrograms(two, "ep", mesh), torch.randn(4, 16))
        with pytest.raises(AuditError, match=r"nn\.Module or a PipelineStage, not str"):
            castwise.audit(RankPrograms(("stage",), "pp"), torch.randn(4, 16))


# the real runs (gloo, one process per rank): a corrupt receive, an aborted all-to-all, a refused
# reduce-scatter, and a clean pipeline; bench_scale.py --only faults --real runs every case
REAL = (
    "pp static: stage 1 reads bf16 bytes as f32 (input_args and output_args given)",
    "pp tuple: stage 0's f32 position table into stage 1's bf16 input_args[1]",
    "ep: rank 3 keeps moe.1's experts in f32",
    "ep dtensor: the dispatch receives bf16 tokens into an f32 buffer",
    "dp: f32 reduce-scattered into bf16",
    "control pp: all stages bf16",
)


@pytest.mark.parametrize("name", REAL)
def test_the_real_gloo_run_fails_exactly_where_the_audit_finds_a_fault(name: str) -> None:
    index = next(i for i, c in enumerate(CASES) if c.name == name)
    outcome = real_outcome(index, timeout=300)
    assert (outcome != "ok") is CASES[index].planted, outcome
