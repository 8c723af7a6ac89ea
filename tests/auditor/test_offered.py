"""The policy clause a finding's fix offers is verified by a re-audit or marked unverified; a
clause on a module whose forward never runs (a RoPE table read by its parent, timm EVA's
`rope.get_embed()`) is called out: an island there casts nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import castwise


class Rope(nn.Module):
    """Holds a float32 table; the parent reads it with get_embed() or calls the module."""

    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, n * d).reshape(n, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table

    def get_embed(self) -> torch.Tensor:
        table: torch.Tensor = self.table
        return table


class Attn(nn.Module):
    def __init__(self, call_rope: bool, d: int = 8) -> None:
        super().__init__()
        self.call_rope = call_rope
        self.qkv = nn.Linear(d, 3 * d)
        self.rope = Rope()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.call_rope:
            q, k = self.rope(q), self.rope(k)
        else:  # as EVA does: the table read directly, the rope module's forward never runs
            emb = self.rope.get_embed()
            q, k = q * emb, k * emb
        out: torch.Tensor = self.proj(F.scaled_dot_product_attention(q, k, v))
        return out


def _model(call_rope: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Attn(call_rope), Attn(call_rope)).to(torch.bfloat16)
    for block in model:
        block.rope.float()  # the table "kept in float32 for precision"
    return model


def _finding(call_rope: bool) -> castwise.Finding:
    report = castwise.audit(_model(call_rope), torch.randn(2, 4, 8, dtype=torch.bfloat16), mode="eval")
    (f,) = report.errors
    assert f.code == "CW102" and "`keep[*.rope]=f32`" in (f.fix or "")
    return f


def test_a_keep_on_a_module_whose_forward_never_runs_is_called_out() -> None:
    f = _finding(call_rope=False)
    assert "the forward of `0.rope` never runs" in (f.fix or "")
    assert f.to_dict()["fix_verified"] is False


def test_a_keep_on_a_module_that_runs_is_verified_by_a_re_audit() -> None:
    f = _finding(call_rope=True)
    assert "never runs" not in (f.fix or "")
    assert (f.fix or "").endswith("(verified by a re-audit)")
    assert f.to_dict()["fix_verified"] is True


@pytest.mark.parametrize("clause", ["keep[*.rope]=f32"])
def test_the_clause_called_out_really_does_not_fix_it(clause: str) -> None:
    report = castwise.audit(
        _model(call_rope=False), torch.randn(2, 4, 8, dtype=torch.bfloat16), policy=f"bf16-true,{clause}", mode="eval"
    )
    assert report.errors  # what the note says: the island changes nothing
