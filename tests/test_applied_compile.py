"""``castwise.apply`` and ``torch.compile`` in either order (also ``fullgraph=True``): the policy's
selectors name the user's modules, Dynamo traces the forwards apply installs, and the compiled
model computes what the applied eager model computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise
from castwise.applied import applied_to
from castwise.errors import AuditError

POLICY = "bf16-true,keep[head]=f32"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.body(x))))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def test_apply_before_or_after_compile_runs_the_policy() -> None:
    x = torch.randn(4, 8)
    reference = _net()
    castwise.apply(reference, POLICY)
    want = reference(x)
    for order in ("before", "after"):
        for fullgraph in (False, True):
            model = _net()
            if order == "before":
                castwise.apply(model, POLICY)
                compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
            else:
                compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
                castwise.apply(compiled, POLICY)
            out = compiled(x)
            out.float().sum().backward()
            where = f"apply {order} compile, fullgraph={fullgraph}"
            assert model.body.weight.dtype == torch.bfloat16, where
            assert model.head.weight.dtype == torch.float32, where  # `head`, not `_orig_mod.head`
            assert model.body.weight.grad is not None and model.body.weight.grad.dtype == torch.bfloat16, where
            assert out.dtype == want.dtype, where
            torch.testing.assert_close(out, want, msg=where)


def test_remove_after_compile_gives_the_model_back() -> None:
    model = _net()
    x = torch.randn(4, 8)
    want = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    applied = castwise.apply(compiled, POLICY)
    assert applied_to(compiled) is applied and applied_to(model) is applied
    assert compiled(x).dtype == torch.bfloat16
    with pytest.raises(AuditError, match=r"under castwise\.apply"):
        castwise.audit(compiled, x)
    applied.remove()
    assert applied_to(compiled) is None
    out = compiled(x)  # recompiled for the forwards as they were
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(out, want)
