"""oneDNN's CPU LSTM in 16-bit: the audit refuses exactly the runs real kernels refuse, per CPU class.

The truth is recorded by tests/trace/rnn_truth.py on real kernels (this machine's class and the
classes it emulates with capped kernels) and re-measured live here for this machine's class.
"""

from __future__ import annotations

import pytest
import torch

import castwise
from castwise import devices

from . import rnn_truth

RECORDED = rnn_truth.recorded()
CASES = [(v, p, m) for v in sorted(RECORDED) for p in rnn_truth.POLICIES for m in rnn_truth.MODES]


def _codes(report: castwise.Report) -> list[str]:
    return [f.code for f in report.errors]


def test_the_record_covers_every_cpu_class() -> None:
    assert sorted(RECORDED) == ["cpu:amx", "cpu:avx2", "cpu:avx512"]


@pytest.mark.parametrize(("variant", "policy", "mode"), CASES)
def test_a_fake_audit_refuses_the_lstm_where_that_class_raised(variant: str, policy: str, mode: str) -> None:
    model, x = rnn_truth.build()
    report = castwise.audit(model, x, policy=policy, mode=mode, device=variant)
    raised = RECORDED[variant][f"{policy}/{mode}"] == "raise"
    assert _codes(report) == (["CW111"] if raised else []), str(report)
    if raised:
        assert "primitive descriptor" in report.errors[0].message and "autocast" in report.errors[0].message


def test_this_machine_measures_what_is_recorded() -> None:
    here = rnn_truth.measure()
    if here["variant"] in RECORDED:
        assert here["cases"] == RECORDED[here["variant"]]


@pytest.mark.parametrize("policy", rnn_truth.POLICIES)
def test_a_real_tensor_audit_agrees_with_the_real_run(policy: str) -> None:
    for mode in rnn_truth.MODES:
        model, x = rnn_truth.build()
        report = castwise.audit(model, x, policy=policy, mode=mode, fake=False)
        raised = rnn_truth.run_real(policy, mode) == "raise"
        assert _codes(report) == (["CW111"] if raised else []), (mode, str(report))


def test_the_emulated_classes_measure_what_is_recorded() -> None:
    host = devices.host_variant()
    lower = [v for v in rnn_truth.CAN_EMULATE.get(host or "", ()) if v in RECORDED]
    for variant in lower:
        assert rnn_truth.measure_emulated(variant)["cases"] == RECORDED[variant], variant


def test_an_lstm_inside_a_model_is_judged_by_its_input_not_by_the_module() -> None:
    # the input autocast cast inside `rnn`, the parent's own ops outside: the same verdicts
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, _ = rnn_truth.build()
            self.head = torch.nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0])

    x = torch.randn(2, 7, 16)
    for variant, cases in RECORDED.items():
        for policy in rnn_truth.POLICIES:
            raised = cases[f"{policy}/eval"] == "raise"
            report = castwise.audit(Net(), x, policy=policy, mode="eval", device=variant)
            assert _codes(report) == (["CW111"] if raised else []), (variant, policy, str(report))
            if raised:
                assert report.errors[0].module == "rnn"
