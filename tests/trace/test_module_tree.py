"""The module tree observer: each module's parameter dtypes and activation dtypes, in reports."""

from __future__ import annotations

import json

import torch
from torch import nn

import castwise
from castwise.trace.module_tree import ModuleTreeObserver
from castwise.trace.observers import default_observers
from castwise.trace.tracer import Tracer, run


class _UpToF32(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 2  # the silent up-cast this tree must flag


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8).to(torch.bfloat16)
        self.up = _UpToF32()
        self.out = nn.Linear(8, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.up(self.inp(x)))


def test_an_audit_report_carries_the_tree_with_dtypes_casts_and_upcasts() -> None:
    model = _Net()
    report = castwise.audit(model, torch.randn(2, 8, dtype=torch.bfloat16), mode="eval")
    tree = report.summary["modules"]
    json.dumps(tree)  # JSON-ready, as the report's JSON form promises
    by = {m["name"]: m for m in tree}
    assert [m["name"] for m in tree] == [n for n, _ in model.named_modules()]
    assert by[""]["type"] == "_Net" and by[""]["outputs"] == ["f32[2, 2]"]
    assert by["inp"]["params"] == {"bf16": 8 * 8 + 8}
    assert (by["inp"]["inputs"], by["inp"]["outputs"]) == (["bf16[2, 8]"], ["bf16[2, 8]"])
    assert by["out"]["params"] == {"f32": 8 * 2 + 2}
    up = by["up"]
    assert (up["inputs"], up["outputs"], up["cast"]) == (["bf16[2, 8]"], ["f32[2, 8]"], True)
    assert up["upcast"] and any(f.code == "CW120" and f.module == "up" for f in report.findings)
    assert not by["inp"]["cast"] and not by["inp"]["upcast"]
    assert by["unused"]["calls"] == 0 and by["unused"]["inputs"] == []
    assert by["out"]["calls"] == 1 and by["out"]["autocast"] is None


def test_autocast_in_force_is_recorded_per_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    report = castwise.audit(model, torch.randn(3, 4), policy="bf16-mixed", device="cuda", mode="train")
    by = {m["name"]: m for m in report.summary["modules"]}
    assert by["0"]["autocast"] == "bf16" and by["0"]["outputs"] == ["bf16[3, 4]"]
    assert by["0"]["cast"]  # f32 in, bf16 out: autocast cast at this boundary
    # CUDA autocast runs layer_norm in float32: a cast at the norm's boundary, not a silent one
    assert by["1"]["outputs"] == ["f32[3, 4]"] and by["1"]["cast"] and not by["1"]["upcast"]


class _Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.float64))  # f64 input against f32 weights: raises


def test_modules_running_when_the_model_raised_are_marked() -> None:
    model = nn.Sequential(_Boom())
    tracer = Tracer(model, "cpu", fake=False, observers=[*default_observers(), ModuleTreeObserver(model)])
    trace = run(tracer, model, (torch.randn(2, 4),), {}, "eval", engine_backward=True)
    assert trace.status == "error"
    by = {m["name"]: m for m in trace.modules}
    assert by["0"]["raised"] and by["0.inner"]["raised"] and by[""]["raised"]
    assert by["0.inner"]["inputs"] == ["f64[2, 4]"] and by["0.inner"]["outputs"] == []


def test_a_module_called_twice_counts_calls_and_keeps_its_first_dtypes() -> None:
    lin = nn.Linear(4, 4)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin(x))

    report = castwise.audit(Twice(), torch.randn(2, 4), mode="eval")
    by = {m["name"]: m for m in report.summary["modules"]}
    assert by["lin"]["calls"] == 2 and by["lin"]["inputs"] == ["f32[2, 4]"]
