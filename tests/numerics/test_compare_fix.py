"""CW320's fix: the real module's island, verified by a re-run with it alone; one fix for a chain."""

from __future__ import annotations

import torch
from torch import nn

import castwise


class OnePassNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean  # one pass: cancels where |mean| >> std
        return self.weight * (x - mean) / (var.abs() + 1e-5).sqrt()


class Chain(nn.Module):
    """A residual stream far from zero through ``depth`` one-pass norms: each adds error alone."""

    def __init__(self, depth: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.norms = nn.ModuleList(OnePassNorm(dim) for _ in range(depth))
        self.mlps = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + 200.0
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            h = h + mlp(norm(h))
        return h


def _run(depth: int) -> tuple[nn.Module, torch.Tensor, castwise.report.Report]:
    torch.manual_seed(0)
    model, x = Chain(depth), torch.randn(4, 8, 32)
    return model, x, castwise.compare(model, (x,), policy="pure_bf16")


def test_one_module_gets_its_own_island_verified() -> None:
    _, _, report = _run(1)
    [finding] = report.findings
    details = dict(finding.details)
    assert finding.code == "CW320" and finding.module == "norms.0"
    assert finding.fix is not None and "`keep[norms.0]=f32`" in finding.fix and "NAME" not in finding.fix
    assert details["fix_verified"] is True and details["error_reduction"] >= 4


def test_a_chain_gets_one_fix_that_alone_brings_the_error_down() -> None:
    model, x, report = _run(4)
    flagged = [f for f in report.findings if f.code == "CW320"]
    assert sorted(f.module or "" for f in flagged) == [f"norms.{i}" for i in range(4)]
    assert {f.fix for f in flagged} == {flagged[0].fix}  # one fix
    details = dict(flagged[0].details)
    assert details["fix_island"] == "class:OnePassNorm" and details["fix_verified"] is True
    before = report.summary["output_err"]
    # the first norm's island alone leaves the error where it was: why it is not the fix
    alone = castwise.compare(model, (x,), policy="pure_bf16,keep[norms.0]=f32").summary["output_err"]
    assert alone > before / 4
    fixed = castwise.compare(model, (x,), policy="pure_bf16,keep[class:OnePassNorm]=f32")
    assert fixed.summary["output_err"] * 4 <= before
