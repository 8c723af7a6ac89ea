"""castwise.run.RunRequest: one check, one wording, and every entry reading a batch object alike."""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import castwise
from castwise.errors import AuditError
from castwise.run import Inputs, check, model_device

Batch = collections.namedtuple("Batch", "x y")


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


class M(nn.Module):
    """Takes one batch object, as a training loop hands it: ``model(batch)``."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, batch: Any) -> torch.Tensor:
        return (self.l(batch.x) - batch.y).pow(2).mean()


class Bad(M):
    def forward(self, batch: Any) -> torch.Tensor:
        return self.l(batch.x.double()).mean()  # a dtype bug of its own


class Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, pair: tuple[torch.Tensor, tuple[torch.Tensor]]) -> torch.Tensor:
        return (self.l(x) + pair[0] * pair[1][0]).mean()


class Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, out: Any) -> torch.Tensor:
        return self.l(out.last_hidden_state).mean()


def _hidden() -> Any:
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=torch.randn(2, 4))


def _x() -> torch.Tensor:
    return torch.randn(2, 4)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any]]] = {
    "namedtuple": (M, lambda: Batch(_x(), _x())),
    "dataclass": (M, lambda: Pair(_x(), _x())),
    "dict": (Keywords, lambda: {"x": _x(), "pair": (_x(), (_x(),))}),
    "nested_tuple": (Keywords, lambda: (_x(), (_x(), (_x(),)))),
    "modeloutput": (Hidden, _hidden),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_audit_and_numerics_read_a_batch_alike(case: str) -> None:
    build, inputs = CASES[case]
    torch.manual_seed(0)
    audit = castwise.audit(build(), inputs(), mode="eval")
    assert audit.findings == [] and [r.status for r in audit.runs] == ["ok"]
    assert castwise.locate_nonfinite(build(), inputs(), mode="eval").findings == []
    compared = castwise.compare(build(), inputs(), policy="bf16-mixed", mode="eval")
    assert not [f for f in compared.findings if f.level == "error"]


def test_a_raising_models_numerics_diagnosis_is_its_own_dtype_error() -> None:
    batch = Batch(_x(), _x())
    audited = castwise.audit(Bad(), batch, mode="eval")
    located = castwise.locate_nonfinite(Bad(), batch, mode="eval")
    compared = castwise.compare(Bad(), batch, policy="bf16-true", mode="eval")
    for report in (located, compared):
        assert [f.code for f in report.findings] == [f.code for f in audited.findings] == ["CW110"]
        assert "raised here; the audit of it: `l` (aten.addmm) receives f64" in report.findings[0].message
        assert "positional argument" not in report.findings[0].message


ENTRIES: dict[str, Callable[..., Any]] = {
    "audit": lambda m, x, **kw: castwise.audit(m, x, **kw),
    "locate_nonfinite": lambda m, x, **kw: castwise.locate_nonfinite(m, x, **kw),
    "forecast": lambda m, x, **kw: castwise.forecast(m, x, target="bf16", **kw),
}


@pytest.mark.parametrize(
    ("bad", "wording"),
    [
        ({"device": "tpu"}, r"device='tpu' is not valid; valid: cpu, cpu:amx, .*, cuda, cuda:a100, .* \(or None"),
        ({"policy": 3}, r"policy must be a castwise\.Policy, a policy string or None, not int"),
        ({"policy": "bf17"}, "policy: "),
        ({"mode": "validate"}, r"mode='validate' is not valid; valid: (both, )?eval, train$"),
    ],
    ids=["device", "policy_type", "policy_text", "mode"],
)
def test_one_wording_for_a_bad_argument_across_entries(bad: dict[str, Any], wording: str) -> None:
    messages = []
    for what, entry in ENTRIES.items():
        with pytest.raises(AuditError) as info:
            entry(M(), Batch(_x(), _x()), **bad)
        messages.append(str(info.value))
        assert re.search(wording, str(info.value)), (what, str(info.value))
    with pytest.raises(AuditError, match=r"compare needs a torch\.nn\.Module, got str; pass the model"):
        castwise.compare("model", _x(), policy="bf16-true")
    assert len({m.replace("both, ", "") for m in messages}) == 1


def test_the_request_is_checked_once_and_keeps_its_parsed_inputs() -> None:
    batch = Batch(_x(), _x())
    request = check("audit", M(), batch, policy="bf16-mixed")
    assert str(request.policy) == "bf16-mixed" and request.device == "cpu" and request.mode == "both"
    assert request.inputs.args == (batch,) and Inputs.of(request.inputs) is request.inputs
    assert request.under(None).inputs is request.inputs
    with pytest.raises(AuditError, match="fake='yes' is not valid; valid: False, True"):
        check("audit", M(), batch, fake="yes")


def test_where_the_model_lives() -> None:
    assert model_device(nn.Linear(2, 2)) == "cpu"
    assert model_device(nn.ReLU()) == "cpu"  # nothing to say where: this machine
    assert model_device(nn.Linear(2, 2, device="meta")) == "cpu"  # audited for, and materialised on, the CPU
