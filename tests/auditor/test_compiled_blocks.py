"""Models compiled block by block (``block.compile()``, ``layers[i] = torch.compile(block)``) and by
Lightning Fabric (``fabric.setup`` re-applies the user's ``torch.compile``) are audited as compiled:
each compiled block's graphs go through the compiled producer, the code between them runs eagerly,
names are the user's. Controls: the eager model (no compiled run) and the whole-model compile."""

from __future__ import annotations

import json
from collections.abc import Callable

import lightning as L
import pytest
import torch

import castwise
from castwise._compiled import CompileOptions, compiled_blocks, user_view
from castwise.auditor.findings import diags_of_run
from castwise.auditor.session import _run_once
from castwise.integrations.frameworks import framed
from castwise.report import Report

from .test_compiled import Net


def _in_place(model: Net) -> Net:
    for block in model.blocks:
        block.compile()
    return model


def _wrapped(model: Net) -> Net:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)
    return model


BLOCKWISE: dict[str, Callable[[Net], Net]] = {"block.compile()": _in_place, "torch.compile(block)": _wrapped}


def _compiled(report: Report) -> dict[str, tuple[int, int]]:
    return {m: (s["graphs"], s["backward_graphs"]) for m, s in report.summary.get("compiled", {}).items()}


def _stray_f32(model: Net) -> Net:
    torch.manual_seed(0)
    model = model.to(torch.bfloat16)
    model.blocks[1].proj.float()  # by hand, inside the second block
    return model


@pytest.mark.parametrize("how", sorted(BLOCKWISE))
def test_a_model_compiled_block_by_block_is_audited_as_compiled(how: str) -> None:
    model = BLOCKWISE[how](Net())
    report = castwise.audit(model, torch.randn(2, 8), policy="bf16-mixed")
    assert [r.kind for r in report.runs] == ["eager", "eager", "compiled", "compiled"]
    assert _compiled(report) == {"train": (2, 2), "eval": (2, 0)}  # one graph per block, each mode
    assert report.ok and "_orig_mod" not in json.dumps(report.to_dict(), default=str)
    # the user's model is as it was: still compiled block by block, nothing cast
    assert [b for b, _o in compiled_blocks(model)] == ["blocks.0", "blocks.1"]
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("how", sorted(BLOCKWISE))
def test_a_fault_inside_a_compiled_block_is_found_by_its_graphs(how: str) -> None:
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"), torch.no_grad():
        _stray_f32(Net())(x)  # the truth: the real run raises in blocks.1.proj
    model = BLOCKWISE[how](_stray_f32(Net()))
    view = user_view(model)
    run = _run_once(
        view,
        x,
        None,
        "cpu",
        "eval",
        True,
        torch.bfloat16,
        True,
        compiled=CompileOptions(blocks=("blocks.0", "blocks.1")),
    )
    assert run.trace.kind == "compiled" and run.trace.compiled is not None and run.trace.compiled.graphs == 2
    found = [(d.code, d.origin.module if d.origin else None) for d in diags_of_run(run)]
    assert found and found[0][1] == "blocks.1.proj", found
    report = castwise.audit(model, x, mode="eval")
    assert {(f.code, f.origin.module if f.origin else None) for f in report.errors} >= {found[0]}
    assert [r.status for r in report.runs if r.kind == "compiled"] == ["error"]


def test_controls_the_eager_model_and_the_whole_model_compile() -> None:
    eager = castwise.audit(Net(), torch.randn(2, 8), policy="bf16-mixed", mode="eval")
    assert [r.kind for r in eager.runs] == ["eager"] and "compiled" not in eager.summary
    whole = castwise.audit(torch.compile(Net()), torch.randn(2, 8), policy="bf16-mixed", mode="eval")
    assert _compiled(whole) == {"eval": (1, 0)}
    in_place = Net()
    in_place.compile()  # the root compiled in place is the whole model's compile
    assert _compiled(castwise.audit(in_place, torch.randn(2, 8), policy="bf16-mixed", mode="eval")) == {"eval": (1, 0)}


def test_a_real_transformers_model_compiled_layer_by_layer() -> None:
    from tests.test_unmatched_rules import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama().to(torch.bfloat16)
    model.model.layers[1].mlp.down_proj.float()  # a fault inside the second compiled layer
    inputs = {"input_ids": torch.randint(0, 64, (1, 8))}
    with pytest.raises(RuntimeError, match="dtype"), torch.no_grad():
        model(**inputs)  # the truth
    eager = castwise.audit(model, inputs, mode="eval")
    for layer in model.model.layers:
        layer.compile()
    report = castwise.audit(model, inputs, mode="eval")
    assert [r.kind for r in report.runs] == ["eager", "compiled"]
    summary = report.summary["compiled"]["eval"]
    assert summary["graphs"] >= 2, summary
    origins = {(f.code, f.origin.module if f.origin else None) for f in report.errors}
    assert origins == {(f.code, f.origin.module if f.origin else None) for f in eager.errors}
    assert any(m == "model.layers.1.mlp.down_proj" for _c, m in origins), str(report)
    assert [r.status for r in report.runs] == ["error", "error"]


# -- Lightning Fabric


def test_a_model_fabric_compiled_is_audited_as_compiled() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    wrapped = fabric.setup(torch.compile(Net()))  # setup takes the compile off, converts, compiles again
    seen = framed(wrapped)
    assert seen is not None and type(seen.user).__name__ == "OptimizedModule"
    report = castwise.audit(seen.audited(None), torch.randn(2, 8), policy=seen.policy, mode="eval")
    assert [r.kind for r in report.runs] == ["eager", "compiled"] and report.ok, str(report)
    assert "_orig_mod" not in json.dumps(report.to_dict(), default=str)


def test_a_block_compiled_model_set_up_by_fabric_is_audited_as_compiled() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    seen = framed(fabric.setup(_in_place(Net())))
    assert seen is not None
    report = castwise.audit(seen.audited(None), torch.randn(2, 8), policy=seen.policy, mode="eval")
    assert _compiled(report) == {"eval": (2, 0)} and report.ok, str(report)
    # control: Fabric's eager model stays eager
    plain = framed(fabric.setup(Net()))
    assert plain is not None
    eager = castwise.audit(plain.audited(None), torch.randn(2, 8), policy=plain.policy, mode="eval")
    assert [r.kind for r in eager.runs] == ["eager"]
