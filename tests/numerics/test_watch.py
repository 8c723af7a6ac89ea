"""watch: a training loop's first non-finite step, replayed under locate_nonfinite."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from castwise.errors import CastwiseError
from castwise.numerics.watch import NonfiniteError, watch
from castwise.report import Report
from tests.numerics import cases


class RandomFault(nn.Module):
    """0/0 at a step drawn from the global generator (so the replay draws the same)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if float(torch.rand(())) < self.p:
            h = h / (h - h)
        return h


def _model(p: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), RandomFault(p), nn.Linear(8, 1))


def _loop(model: nn.Module, steps: int, w: object | None = None, external_loss: bool = False) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    done = 0
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        if external_loss and w is not None:
            w.check(loss, replay=lambda m, x=x, y=y: nn.functional.mse_loss(m(x), y))  # type: ignore[attr-defined]
        loss.backward()
        opt.step()
        opt.zero_grad()
        done += 1
    return done


def test_raises_at_the_first_nonfinite_step_naming_the_producer() -> None:
    model = _model(0.1)
    with pytest.raises(NonfiniteError) as info, watch(model) as w:
        _loop(model, 200)
    f = info.value.report.findings[0]
    assert (f.code, f.module, f.op) == ("CW302", "2", "aten.div")
    assert "forward" not in model.__dict__  # unwrapped
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())  # stopped before the optimizer
    assert 1 <= w.steps < 200


def test_warn_and_callback_actions_keep_training() -> None:
    model = _model(0.1)
    seen: list[Report] = []
    with watch(model, on_nonfinite=seen.append) as w:
        done = _loop(model, 40)
    assert done == 40 and len(seen) == 1 and seen[0] is w.report
    model = _model(0.1)
    with warnings.catch_warnings(record=True) as caught, watch(model, on_nonfinite="warn"):
        warnings.simplefilter("always")
        _loop(model, 40)
    assert any("CW302" in str(c.message) for c in caught)


def test_check_with_an_external_loss_replays_the_loss_computation() -> None:
    model, (x, y) = cases.log_of_zero_in_loss()
    body = nn.Sequential(model.body)
    with pytest.raises(NonfiniteError) as info, watch(body, check_outputs=False) as w:
        out = body(x)
        loss = model.loss(torch.relu(out).softmax(-1), y)
        w.check(loss, replay=lambda m: model.loss(torch.relu(m(x)).softmax(-1), y))
    assert info.value.report.findings[0].op == "aten.log"


def test_gradient_norm_check_finds_a_backward_producer() -> None:
    model, (x,) = cases.backward_sqrt_at_zero()
    with pytest.raises(NonfiniteError) as info, watch(model) as w:
        model(x).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        w.check(grad_norm=norm)
    f = info.value.report.findings[0]
    assert (f.code, f.module, dict(f.details)["phase"]) == ("CW302", "1", "backward")


def test_a_finite_loop_costs_no_replay_and_eval_is_not_recorded() -> None:
    model = _model(0.0)
    with watch(model) as w:
        _loop(model, 5)
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 8))
    assert w.report is None and w.steps == 5


def test_bad_action_says_what_is_valid() -> None:
    with pytest.raises(CastwiseError, match="valid: raise, warn"):
        watch(nn.Linear(2, 2), on_nonfinite="explode")
