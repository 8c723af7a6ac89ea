"""The zoo benchmarks' harness: the registry, seeded fault planting, the real-run scoring rules
on hand-built cases whose answer is known, and a smoke run of 3 models x 2 fault classes."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from benchmarks.zoo import models
from benchmarks.zoo.cases import Case, build_case, evaluate, fault_case, fault_class
from benchmarks.zoo.faults import FAULTS, NotApplicable
from benchmarks.zoo.scoring import (
    AuditOutcome,
    DtypeFlops,
    FindingView,
    RealOutcome,
    low_share,
    real_run,
    run_mode,
    score,
)
from benchmarks.zoo.situations import SITUATIONS
from benchmarks.zoo.summary import metrics
from torch import nn


def finding(
    code: str = "CW110",
    origin: str | None = "0",
    modes: tuple[str, ...] = ("train", "eval"),
    level: str = "error",
    message: str = "`0` receives bf16, which its kernel refuses",
) -> FindingView:
    return FindingView(code, level, modes, "0", origin, (), message, "keep it in bf16", f"`{origin}`")


FAILED = {"train": RealOutcome("dtype_error", "mat1 and mat2"), "eval": RealOutcome("dtype_error", "mat1 and mat2")}
PASSED = {"train": RealOutcome("ok"), "eval": RealOutcome("ok")}


def test_registry_has_50_models_from_every_library_a_fifth_held_out() -> None:
    zoo = models.models()
    assert len(zoo) >= 50
    assert {m.library for m in zoo} == {
        "transformers",
        "timm",
        "torchvision",
        "open_clip",
        "diffusers",
        "peft",
        "torch.nn",
    }
    held = sum(m.heldout for m in zoo) / len(zoo)
    assert 0.15 <= held <= 0.30


def test_a_planted_fault_is_seeded_and_survives_a_deep_copy() -> None:
    case = Case("nn_mlp", "bf16-hand", "upcast_input_no_castback", 7)
    model_a, inputs, planted_a = build_case(case)
    _, _, planted_b = build_case(case)
    assert planted_a == planted_b  # the same seed plants at the same place
    assert planted_a is not None and planted_a.expected_origin == planted_a.module_name
    clone = copy.deepcopy(model_a)  # the audit copies the model: the copy must carry the fault
    for m in ("train", "eval"):
        assert real_run(copy.deepcopy(model_a), inputs, None, m) == real_run(copy.deepcopy(clone), inputs, None, m)


def test_a_fault_with_no_place_in_the_model_is_not_applicable() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with pytest.raises(NotApplicable):
        FAULTS["qkv_mismatch"].plant(model, random.Random(0))


def test_a_stray_fp32_linear_fails_for_real_and_a_wrong_origin_is_counted_wrong() -> None:
    case = Case("nn_mlp", "bf16-hand", "stray_fp32_module", 3)
    _, _, planted = build_case(case)
    assert planted is not None
    real = {m: real_run(*build_case(case)[:2], None, m) for m in ("train", "eval")}
    assert {r.status for r in real.values()} == {"dtype_error"}  # a bf16 activation into an f32 Linear
    other = next(str(i) for i in (0, 2, 5) if str(i) != planted.module_name)
    wrong = score(real, AuditOutcome("done", ok=False, findings=(finding(origin=other),)), planted.expected_origin)
    assert wrong.detected and wrong.origin_right is False and wrong.origin_seen == other
    right = score(
        real, AuditOutcome("done", ok=False, findings=(finding(origin=planted.module_name),)), planted.expected_origin
    )
    assert right.detected and right.origin_right is True


def test_origin_inside_the_planted_module_and_culprits_count_as_right() -> None:
    inner = score(FAILED, AuditOutcome("done", ok=False, findings=(finding(origin="block.attn.q"),)), "block.attn")
    assert inner.origin_right is True
    prefix = score(FAILED, AuditOutcome("done", ok=False, findings=(finding(origin="block.attn2"),)), "block.attn")
    assert prefix.origin_right is False  # a sibling sharing a name prefix is not inside
    culprit = FindingView("CW110", "error", ("train",), "x", None, ("block.attn",), "m", "f", "")
    assert score(FAILED, AuditOutcome("done", ok=False, findings=(culprit,)), "block.attn").origin_right is True


def test_warnings_are_not_detections_and_errors_where_the_run_passes_are_false_alarms() -> None:
    only_warnings = AuditOutcome(
        "done",
        ok=True,
        incomplete=True,
        findings=(finding("CW902", level="warning"), finding("CW901", level="warning")),
    )
    s = score(FAILED, only_warnings, "0")
    assert s.missed and not s.detected and s.incomplete and s.incomplete_ok
    mixed = {"train": RealOutcome("dtype_error", "hook"), "eval": RealOutcome("ok")}
    s = score(mixed, AuditOutcome("done", ok=False, findings=(finding(modes=("eval",)),)), "0")
    assert not s.detected and s.missed and s.false_alarm_modes == ("eval",)
    s = score(PASSED, AuditOutcome("crash", message="KeyError"), "0")
    assert s.crash and not s.false_alarm_modes


def test_empty_slots_are_found_and_clean_messages_pass() -> None:
    bad = score(FAILED, AuditOutcome("done", ok=False, findings=(finding(message="`0` receives , which fails"),)), "0")
    assert bad.empty_slots and "receives , which" in bad.empty_slots[0]
    also = score(FAILED, AuditOutcome("done", ok=False, findings=(finding(message="Also at ``."),)), "0")
    assert also.empty_slots
    assert score(FAILED, AuditOutcome("done", ok=False, findings=(finding(),)), "0").empty_slots == ()
    calls = finding(message="a tensor attribute .to() does not convert (`.item()`, `if x.any():`)")
    assert score(FAILED, AuditOutcome("done", ok=False, findings=(calls,)), "0").empty_slots == ()
    meets = finding(message="`x.a` is f32 and meets . Real error: mat1")
    assert score(FAILED, AuditOutcome("done", ok=False, findings=(meets,)), "0").empty_slots


def test_low_precision_share_counts_matmul_flops_by_dtype() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].to(torch.bfloat16)
    model[1].register_forward_pre_hook(lambda m, a: (a[0].to(torch.bfloat16),))
    counter = DtypeFlops()
    with counter:
        run_mode(model, torch.randn(4, 8), "eval")
    assert low_share(dict(counter.by_dtype), torch.bfloat16) == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["nn_mlp", "nn_convnet", "gpt2"])
@pytest.mark.parametrize("fault", ["stray_fp32_module", "output_hook_dtype"])
def test_smoke_evaluate_scores_each_case_consistently(name: str, fault: str) -> None:
    case = Case(name, "bf16-hand", fault, 11)
    record = evaluate(case, timeout=300)
    s = record["score"]
    assert record["audit"]["status"] == "done"
    assert s["real_failed"] == any(r["status"] == "dtype_error" for r in record["real"].values())
    assert s["detected"] != s["missed"] or not s["real_failed"]
    if fault == "stray_fp32_module" and any(k in record["planted"]["description"] for k in ("(Linear)", "(Conv2d)")):
        assert s["real_failed"]  # a bf16 activation reaches the f32 weight
    if record["fix"] is not None and record["fix"]["verified"]:
        share = record["fix"]["low_share"]
        assert share is None or 0.0 <= share <= 1.0
    totals = metrics([record])
    assert totals["cases"] == 1 and totals["detected"] == int(s["detected"])


def test_fault_cases_are_deterministic_and_use_the_fault_classes_in_turn() -> None:
    a = [fault_case(i, heldout=False) for i in range(3)]
    assert a == [fault_case(i, heldout=False) for i in range(3)]
    assert [c.fault for c in a if c is not None] == sorted(FAULTS)[:3]
    held = fault_case(0, heldout=True)
    assert held is not None and models.REGISTRY[held.model].heldout
    assert all(c is None or (c.situation in FAULTS[c.fault or ""].situations and c.situation in SITUATIONS) for c in a)


def test_the_classes_filter_keeps_the_indices_of_those_classes_and_refuses_unknown_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks.bench_fault_injection import main as bench_main

    n = len(FAULTS)
    assert [fault_class(i) for i in range(2 * n)] == sorted(FAULTS) * 2
    assert all(fault_case(i, heldout=False).fault == fault_class(i) for i in (0, 5))  # type: ignore[union-attr]
    with pytest.raises(SystemExit) as stop:
        bench_main(["--classes", "index_put_mismatch,no_such_class", "--limit", "1"])
    assert stop.value.code == 2
    assert "no_such_class" in capsys.readouterr().err
