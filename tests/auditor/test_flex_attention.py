"""FlexAttention (torchtitan's default attention) audited on CPU and on simulated CUDA.

On simulated CUDA the op's autograd wrapper builds its backward graph through the C++ autograd
engine, which asks the real CUDA runtime for a context (``hasPrimaryContext``): a limit of the
simulation, so the audit is incomplete (CW902, exit code 3), never an error in the model. On CPU
the audit reports what this torch's real eager training step does (2.14: ``FlexAttention does
not support backward on CPU``, raised before anything else).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import castwise


def _causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q >= kv


class _Flex(nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.masked = masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = create_block_mask(_causal, B=None, H=None, Q_LEN=t, KV_LEN=t, device=x.device) if self.masked else None
        out: torch.Tensor = flex_attention(q, k, v, block_mask=mask)
        return out


X = torch.randn(1, 128, 16)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("policy", [None, "bf16-mixed"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "block-mask"])
def test_simulated_cuda_is_incomplete_not_an_error(masked: bool, policy: str | None) -> None:
    report = castwise.audit(_Flex(masked), X, policy=policy, device="cuda")
    codes = [f.code for f in report.findings]
    assert not report.errors, [f.message for f in report.errors]
    # what the simulation cannot run is said (torch 2.14: the autograd engine asks for a CUDA context)
    assert report.incomplete == ("CW902" in codes), codes


def _real_error() -> BaseException | None:
    try:
        _Flex(True)(X).sum().backward()
    except Exception as exc:  # this torch's eager CPU training step (2.14: no backward on CPU)
        return exc
    return None


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
@pytest.mark.parametrize("policy", [None, "bf16-mixed"])
def test_cpu_reports_what_the_real_run_raises(policy: str | None, fake: bool) -> None:
    real = _real_error()
    report = castwise.audit(_Flex(True), X, policy=policy, fake=fake)
    if real is None:
        assert not report.errors, [f.message for f in report.errors]
    else:
        assert [f.code for f in report.errors] == ["CW130"]
        assert str(real).splitlines()[0] in report.errors[0].message
    # the model's own torch.compile refusing the tracer's dispatch mode is the audit's limit
    assert all("dispatch mode" not in f.message for f in report.findings if f.level == "error")
    limits = [f.message for f in report.findings if f.code == "CW902"]
    assert all("castwise's tracer" in m and "fake tensors cannot" not in m for m in limits), limits


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_real_run_after_an_audit_is_as_before(device: str) -> None:
    """flex_attention compiles a wrapper with Dynamo, which skips it under the tracer's dispatch
    mode; torch 2.10 marked its code skipped for good, and every later real call in the process
    failed inside the dense implementation ("marked as skipped"). The audit leaves Dynamo as it was."""
    before = _real_error()
    castwise.audit(_Flex(True), X, device=device)
    after = _real_error()
    assert type(after) is type(before), after
    assert str(after).splitlines()[:1] == str(before).splitlines()[:1]
