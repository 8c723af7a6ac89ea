"""A new rule and a new device plug in from their own modules: nothing else is edited."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import castwise
from castwise import devices
from castwise import rules as catalog
from castwise.auditor.context import Ctx
from castwise.rules._rule import Rule
from castwise.rules.audit import AuditRule, Check, ordered_checks
from castwise.rules.audit._base import Diag
from castwise.trace.contracts import Violation, tensor_args

# -- a toy rule: everything it needs is here ---------------------------------------------------

_TOY_META = Rule(
    code="CW199",
    name="toy-relu-in-bfloat16",
    category="MODEL_INPUT_DTYPE_MISMATCH",
    severity="error",
    summary="A toy rule for the extension test.",
    detects="relu refused in bf16 on the toy device.",
    why="It shows a rule plugs in.",
    example="model(x)",
    fix="Run relu in float32.",
)


def _toy_match(ctx: Ctx) -> Diag | None:
    if ctx.op != "aten.relu":
        return None
    return ctx.diag("CW199", f"{ctx.at}: toy says relu refuses {ctx.got}.", "Run relu in float32.")


TOY_RULE = AuditRule(_TOY_META, checks=(Check("CW199", _toy_match),), before="CW111")

# -- a toy device: a registry entry and one contract delta ------------------------------------


def _relu_without_bf16(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], dev: devices.Device) -> Any:
    x = args[0]
    if x.dtype == torch.bfloat16:
        return Violation(
            op,
            "unsupported",
            "\"relu_toy\" not implemented for 'BFloat16'",
            (tensor_args(args, kwargs).index(x),),
            "float32",
        )
    return x.dtype


TOY_DEVICE = devices.Device(
    "toy",
    autocast_type="cpu",
    kernels="cpu",
    tensor_prefix="torch.toy.",
    label="TOY",
    fake_device="cpu",
    contracts={"aten.relu": _relu_without_bf16},
)


@pytest.fixture
def toy_device() -> Iterator[devices.Device]:
    devices.register(TOY_DEVICE)
    try:
        yield TOY_DEVICE
    finally:
        devices.unregister("toy")


@pytest.fixture
def toy_rule() -> Iterator[AuditRule]:
    catalog.register(TOY_RULE)
    try:
        yield TOY_RULE
    finally:
        catalog.unregister("CW199")


def _bf16_relu_model() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(torch.bfloat16), torch.randn(2, 4, dtype=torch.bfloat16)


def test_a_toy_device_brings_its_own_contract_delta(toy_device: devices.Device) -> None:
    model, x = _bf16_relu_model()
    on_cpu = castwise.audit(model, x, device="cpu", mode="eval")
    on_toy = castwise.audit(model, x, device="toy", mode="eval")
    assert on_cpu.ok
    assert [(f.code, f.module) for f in on_toy.errors] == [("CW111", "1")]
    assert "TOY kernel for bf16" in on_toy.errors[0].message


def test_a_toy_rule_takes_its_place_in_the_precedence(toy_device: devices.Device, toy_rule: AuditRule) -> None:
    keys = [c.key for c in ordered_checks()]
    assert keys.index("CW199") == keys.index("CW111") - 1  # `before="CW111"`
    model, x = _bf16_relu_model()
    report = castwise.audit(model, x, device="toy", mode="eval")
    assert [f.code for f in report.errors] == ["CW199"]
    assert catalog.get("CW199").page().startswith("CW199 toy-relu-in-bfloat16")


def test_the_toy_rule_leaves_no_trace_once_unregistered(toy_device: devices.Device) -> None:
    catalog.register(TOY_RULE)
    catalog.unregister("CW199")
    assert "CW199" not in catalog.REGISTRY
    assert "CW199" not in [c.key for c in ordered_checks()]


def test_an_unknown_device_is_refused_with_the_valid_ones() -> None:
    model, x = _bf16_relu_model()
    valid = r"valid: cpu, cpu:amx, .*, cuda, cuda:a100, .* \(or None"
    with pytest.raises(castwise.AuditError, match=rf"device='mps' is not valid; {valid}"):
        castwise.audit(model, x, device="mps")
    with pytest.raises(castwise.CastwiseError, match=r"valid: cpu, cpu:amx, .*, cuda, "):
        devices.get("mps")
