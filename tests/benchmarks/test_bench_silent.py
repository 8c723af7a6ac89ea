"""The silent-precision benchmark: its truth measured for real on three small cases (a planted
case confirmed against its fix, a control small against its bug twin), the scorer's matching
rules on hand-built findings, the registry's coverage, and one audit run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.bench_silent import main, truth_of
from benchmarks.silent.cases import CASES, CONTROLS, PLANTED, Expect
from benchmarks.silent.scoring import Seen, at_op, at_origin, op_name
from benchmarks.silent.truth import RATIO


@pytest.mark.parametrize("name", ["neox_rope_positions_type_as", "dit_timestep_to_dtype"])
def test_a_planted_case_measures_a_large_gap_and_its_fix_a_small_one(name: str) -> None:
    truth = truth_of(CASES[name])
    assert truth["confirmed"], truth
    assert truth["recipe"] >= RATIO * truth["other"] > 0
    assert truth["recipe"] > 0.01  # a gap well above bf16's own rounding of the output


def test_a_control_measures_small_against_its_bug_twin() -> None:
    truth = truth_of(CASES["rope_f32_type_as"])
    assert truth["small"], truth
    assert 0 < truth["recipe"] * RATIO <= truth["other"]


def test_the_registry_covers_every_family_with_real_threads() -> None:
    assert len(PLANTED) >= 24 and len(CONTROLS) >= 8
    assert {c.family for c in PLANTED} == {"lm", "vit", "dit", "moe", "kernel"}
    assert len(CASES) == len(PLANTED) + len(CONTROLS)  # names unique
    for case in PLANTED:
        assert case.expect is not None and case.expect.ops and case.expect.origin, case.name
        assert "#" in case.thread or "transformers" in case.thread, case.name
    assert all(c.expect is None for c in CONTROLS)


def seen(op: str, module: str, origin_module: str | None = None, tensor: str | None = None) -> Seen:
    return Seen("CW141", op, module, origin_module, tensor)


def test_the_op_is_matched_by_its_aten_name_in_the_module_or_inside_it() -> None:
    expect = Expect(("_log_softmax",), "loss_fn", ("lm.lm_head",))
    assert op_name("aten._log_softmax.default") == op_name("aten::_log_softmax") == "_log_softmax"
    assert at_op(seen("aten._log_softmax.default", "loss_fn"), expect)
    assert at_op(seen("_log_softmax", "loss_fn.inner"), expect)
    assert not at_op(seen("_log_softmax", "loss_fn2"), expect)  # a sibling sharing a prefix
    assert not at_op(seen("aten.mm.default", "loss_fn"), expect)


def test_the_origin_is_a_module_or_a_named_tensor() -> None:
    expect = Expect(("mul",), "lm.model.rotary_emb", ("lm.model.rotary_emb", "position_ids"))
    assert at_origin(seen("mul", "x", "lm.model.rotary_emb"), expect)
    assert at_origin(seen("mul", "x", "", "input position_ids"), expect)
    assert at_origin(seen("mul", "x", None, "buffer lm.model.rotary_emb.inv_freq"), expect)
    assert not at_origin(seen("mul", "x", "lm.model", "input input_ids"), expect)
    assert not at_origin(seen("mul", "x", None, "input position_ids_2"), expect)


def test_one_planted_case_and_one_control_audit_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "silent.json"
    argv = ["--cases", "dit_timestep_to_dtype,rope_f32_type_as", "--devices", "cpu", "--no-truth"]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["case"] for r in data["results"]] == ["dit_timestep_to_dtype", "rope_f32_type_as"]
    assert data["summary"]["cpu"]["crashes"] == 0
    assert data["summary"]["harness_errors"] == 0
    control = data["results"][1]["audits"][0]
    assert control["clean"] == (not control["seen"])


def test_the_fix_column_verifies_a_planted_case_for_real(tmp_path: Path) -> None:
    out = tmp_path / "silent.json"
    argv = ["--cases", "neox_rope_positions_type_as,rope_f32_type_as", "--devices", "cpu", "--no-truth", "--fix"]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    planted, control = data["results"]
    fix = planted["fix"]["cpu"]
    assert fix["verified"] and fix["findings"][0]["clause"] == "keep[attn.rotary]=f32", fix
    assert fix["findings"][0]["reduction"] >= 4, fix
    assert "fix" not in control  # a control has nothing to verify
    assert data["summary"]["fix"]["cpu"] == {"cases": 1, "verified": 1, "crashes": 0}
