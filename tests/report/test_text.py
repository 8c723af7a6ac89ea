"""The text renderer wraps prose, never a policy, a module path or a code span."""

from __future__ import annotations

import pytest

from castwise.report import Finding, Report, render_finding, render_report

POLICY = "bf16-mixed,keep[_orig_mod.transformer.h.*.ln_2]=f32,keep[_orig_mod.lm_head]=f32"
CALL = "castwise.apply(model, castwise.Policy.parse(...))"


@pytest.mark.parametrize("width", [60, 80, 100])
def test_a_policy_longer_than_the_room_left_moves_to_the_next_line_whole(width: int) -> None:
    fix = f"Keep the norms of every block in float32 with the policy {POLICY} and re-run the audit."
    finding = Finding("CW101", "the norm runs in bf16", module="_orig_mod.transformer.h.0.ln_2", fix=fix)
    lines = render_finding(finding, width)
    assert any(POLICY in line for line in lines), lines
    # only a policy longer than a whole line may pass the width: it is never cut
    assert all(len(line) <= width or line.strip() == POLICY for line in lines), lines


@pytest.mark.parametrize("width", [60, 80, 100])
def test_code_spans_and_calls_stay_on_one_line(width: int) -> None:
    fix = (
        "Check the rest on real tensors, a long sentence to push the span to the end of a line: "
        "`castwise audit <file.py:build> --real`, or apply the fix with "
        f"{CALL} before the first step."
    )
    text = "\n".join(render_finding(Finding("CW101", "the norm runs in bf16", fix=fix), width))
    assert "`castwise audit <file.py:build> --real`" in text
    assert CALL in text


def test_the_suggested_policy_line_keeps_the_call_whole() -> None:
    report = Report(findings=[], title="castwise audit model.py:build", suggested_policy=POLICY)
    text = render_report(report, 80)
    assert any(POLICY in line for line in text.splitlines()) and CALL in text
