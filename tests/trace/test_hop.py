"""Higher-order operators under the tracer: torch.cond's branches are checked, not refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: self.a(t), lambda t: self.b(t), (x,))


def test_a_model_calling_torch_cond_is_audited_not_refused() -> None:
    """torch routes cond to a dispatch mode only when it supports higher-order operators; the
    tracer did not, and the audit reported the model raising (CW130) while it runs."""
    torch.manual_seed(0)
    model, x = Branches(), torch.randn(2, 4)
    assert model(x).shape == (2, 4)  # runs for real
    for policy in (None, "bf16-mixed"):
        report = castwise.audit(model, x, policy=policy, device="cpu")
        assert report.ok and not report.findings, str(report)
    # Dynamo's state of eager torch.cond is as before the audit (torch 2.12 skipped its wrapper
    # for good after a traced run, and every later torch.cond in the process raised)
    assert Branches()(x).shape == (2, 4)


class UpcastBranch(Branches):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the false branch feeds f32 into a bf16 layer
        return torch.cond(x.sum() > 0, lambda t: self.a(t), lambda t: self.b(t.float()).to(t.dtype), (x,))


def test_the_branch_torch_cond_does_not_take_on_these_inputs_is_checked_too() -> None:
    """With a fake predicate either branch may run, so both are checked: these inputs take the
    true branch and run, other data takes the false one, which refuses its dtypes for real."""
    torch.manual_seed(0)
    model = UpcastBranch().to(torch.bfloat16)
    x = torch.ones(2, 4, dtype=torch.bfloat16)  # the true branch's inputs
    model(x)
    with pytest.raises(RuntimeError, match="dtype"):
        model(-x)
    report = castwise.audit(model, x, device="cpu", mode="eval")
    assert [f.module for f in report.errors] == ["b"], str(report)
