"""CW118: a module made after the framework converted the model (Lightning's convert_module ran at
setup; `castwise run` audits such a run as `converted=on`). Truth: the real CPU run of the same
model raises the error the finding quotes; the look-alikes run."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import castwise


class _Net(nn.Module):
    def __init__(self, upcast: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h.float() if self.upcast else h)


def _converted_then_head(upcast: bool = False) -> nn.Module:
    model = _Net(upcast).to(torch.bfloat16)  # what Lightning's HalfPrecision.convert_module does
    model.head = nn.Linear(8, 2)  # made after it (on_fit_start, after fabric.setup)
    return model


def _real_error(model: nn.Module, x: torch.Tensor) -> str | None:
    try:
        model(x.to(torch.bfloat16))  # the plugin casts the inputs too
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def test_a_head_made_after_the_conversion_names_the_order_not_a_hand_cast() -> None:
    x = torch.randn(4, 8)
    real = _real_error(_converted_then_head(), x)
    report = castwise.audit(_converted_then_head(), x, policy="lightning:bf16-true,converted=on", mode="eval")
    assert [f.code for f in report.errors] == ["CW118"], str(report)
    f = report.errors[0]
    assert real is not None and real in f.message
    assert f.module == "head" and f.origin is not None and f.origin.tensor == "param head.weight"
    assert "made after that conversion" in f.message and "by hand" not in f.message
    assert "configure_model()" in (f.fix or "") and "init_module()" in (f.fix or "")


@pytest.mark.parametrize(
    "policy, upcast",
    [("lightning:bf16-true,converted=on", True), ("lightning:bf16-true", False)],
    ids=["deliberate-f32-head", "castwise-converts"],
)
def test_look_alikes_are_clean(policy: str, upcast: bool) -> None:
    # an f32 head fed f32 on purpose runs; without converted=on castwise converts the head itself
    x = torch.randn(4, 8)
    if upcast:
        assert _real_error(_converted_then_head(upcast), x) is None
    report = castwise.audit(_converted_then_head(upcast), x, policy=policy, mode="eval")
    assert not report.errors, str(report)


def _cw122_names(report: castwise.Report) -> list[str]:
    return [f.message for f in report.findings if f.code == "CW122"]


@pytest.mark.parametrize(
    "head",
    [lambda: nn.Linear(8, 2), lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))],
    ids=["one-layer", "a-subtree"],
)
def test_cw122_stands_down_where_cw118_explains_the_same_tensors(head: Callable[[], nn.Module]) -> None:
    # one fact (the head was made after the conversion), one finding: not also "probably cast by hand"
    model = _Net().to(torch.bfloat16)
    model.head = head()
    report = castwise.audit(model, torch.randn(4, 8), policy="lightning:bf16-true,converted=on", mode="eval")
    assert [f.code for f in report.findings] == ["CW118"], str(report)


def test_cw122_still_reports_what_cw118_does_not_explain() -> None:
    # look-alikes: a tensor left off the policy elsewhere in the same model, and a late f32 head
    # fed f32 on purpose (nothing refuses it, so no CW118 claims it)
    model = _converted_then_head()
    model.body.register_buffer("scale", torch.ones(8))  # made after the conversion too, never refused
    report = castwise.audit(model, torch.randn(4, 8), policy="lightning:bf16-true,converted=on", mode="eval")
    assert [f.code for f in report.findings] == ["CW118", "CW122"], str(report)
    (text,) = _cw122_names(report)
    assert "`body.scale`" in text and "head" not in text
    upcast = castwise.audit(
        _converted_then_head(upcast=True), torch.randn(4, 8), policy="lightning:bf16-true,converted=on", mode="eval"
    )
    assert [f.code for f in upcast.findings] == ["CW122"] and "`head.weight`" in _cw122_names(upcast)[0]
