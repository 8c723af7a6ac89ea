"""Every way a model reads its parameters, audited fake and real, against the real CPU run.

``param.data`` reaches the dispatch mode as ``detach`` carrying nn.Parameter's type; a real-tensor
audit once took that for a foreign tensor subclass and ended in a false CW130 ("Multiple dispatch
failed for 'torch.ops.aten.detach'"). Truth is the model run for real: clean where it runs, a dtype
finding (never CW130) where the real kernel raises.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import castwise


def _data(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, m.weight.data, m.bias)


def _detach(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, m.weight.detach(), m.bias)


def _no_grad(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        w = m.weight * 1
    return F.linear(x, w)


def _transpose(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ m.weight.T


def _vars(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, vars(m)["_parameters"]["weight"])


def _parameters(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, m._parameters["weight"])


def _functional_call(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.func.functional_call(m, {"weight": m.weight, "bias": m.bias}, (x,))
    return out


READS: dict[str, Callable[[nn.Linear, torch.Tensor], torch.Tensor]] = {
    "data": _data,
    "detach": _detach,
    "no_grad": _no_grad,
    "T": _transpose,
    "vars": _vars,
    "_parameters": _parameters,
    "functional_call": _functional_call,
}


class _Reads(nn.Module):
    def __init__(self, read: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8).to(dtype)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return READS[self.read](self.l, x)


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(self.dtype)


def _parametrized(read: str, dtype: torch.dtype) -> nn.Module:
    layer = nn.Linear(8, 8)
    parametrize.register_parametrization(layer, "weight", _Cast(dtype), unsafe=True)
    return layer


def _runs_for_real(model: nn.Module, x: torch.Tensor) -> bool:
    try:
        copy.deepcopy(model)(x)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("read", [*READS, "parametrize"])
def test_audit_agrees_with_the_real_run(read: str, dtype: torch.dtype, fake: bool) -> None:
    torch.manual_seed(0)
    model = _parametrized(read, dtype) if read == "parametrize" else _Reads(read, dtype)
    x = torch.randn(2, 8)
    runs = _runs_for_real(model, x)
    assert runs == (dtype == torch.float32)  # the bf16 weight meets the f32 input: a real error
    report = castwise.audit(model, x, fake=fake)
    codes = [f.code for f in report.findings if f.severity == "error"]
    assert "CW130" not in codes, [f.message for f in report.findings]
    assert not report.incomplete
    assert report.ok == runs, codes
