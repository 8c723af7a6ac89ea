"""A model's own dtype assert: the finding's origin is the tensor the failing line reads.

A RoPE table kept in f32 (``assert freqs.dtype == torch.float32``) that a loader cast to bf16 once
came out with the model's input as origin; the failing line names the table, and the run's
record knows where it came from. Truth is the real run: it raises the same AssertionError.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise


class _Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.randn(4, 8), persistent=False)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = self.freqs
        h = self.proj(x)
        assert freqs.dtype == torch.float32
        return h * freqs


class _RopeWithMessage(_Rope):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        assert self.freqs.dtype == torch.float32, f"freqs must stay float32, got {self.freqs.dtype}"
        return h * self.freqs


class _QK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        k = self.k(x).float()  # kept in f32 "for stability": autocast left q in bf16
        assert q.dtype == k.dtype, "q and k must share a dtype"
        return q @ k.T


def _cast_table(model: _Rope) -> _Rope:
    model.freqs = model.freqs.to(torch.bfloat16)  # the checkpoint loader's blanket cast
    return model


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
@pytest.mark.parametrize("cls", [_Rope, _RopeWithMessage])
def test_a_cast_rope_table_is_the_origin(cls: type[_Rope], fake: bool) -> None:
    model, x = _cast_table(cls()), torch.randn(4, 8)
    with pytest.raises(AssertionError):
        model(x)
    report = castwise.audit(model, x, fake=fake)
    errors = [f for f in report.findings if f.severity == "error"]
    assert len(errors) == 1 and errors[0].code != "CW130", [f.message for f in errors]
    assert "freqs" in str(errors[0].origin), errors[0].origin
    assert "proj" not in str(errors[0].origin) and "`x`" not in str(errors[0].origin)


def test_a_bare_assert_is_quoted_by_its_line() -> None:
    report = castwise.audit(_cast_table(_Rope()), torch.randn(4, 8))
    # pytest rewrites this file's asserts to carry their values; plain Python's carry nothing
    message = report.findings[0].message
    assert "== torch.float32" in message and "AssertionError: AssertionError" not in message


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_q_k_assert_names_the_cast_operand(fake: bool) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(AssertionError), torch.autocast("cpu", torch.bfloat16):
        _QK()(x)
    report = castwise.audit(_QK(), x, policy="bf16-mixed", fake=fake)
    errors = [f for f in report.findings if f.severity == "error"]
    assert len(errors) == 1 and errors[0].code != "CW130"
    assert errors[0].origin is not None and errors[0].origin.op == "aten._to_copy", errors[0].origin
