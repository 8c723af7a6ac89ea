"""The rule API (castwise.rules.api): below the engine, and what the engine hands the rules fits it."""

from __future__ import annotations

import grimp
import torch

import castwise
from castwise.auditor.context import FixContext, make_ctx
from castwise.devices import CPU
from castwise.report import Finding
from castwise.rules import api
from castwise.rules.audit import _fixes
from castwise.trace.events import Prov

_ABOVE = ("castwise.auditor", "castwise.report", "castwise.trace", "castwise.applied", "castwise.policy")


def test_no_rule_module_imports_the_engine_not_even_for_types() -> None:
    graph = grimp.build_graph("castwise", exclude_type_checking_imports=False)
    upward = {
        (m, x)
        for m in graph.find_descendants("castwise.rules") | {"castwise.rules"}
        for x in graph.find_modules_directly_imported_by(m)
        if x.startswith(_ABOVE)
    }
    assert upward == set()


def test_the_engine_values_are_the_api_values() -> None:
    # one class each, wherever users import it from
    assert castwise.report.Finding is api.Finding and castwise.report.CodeFix is api.CodeFix
    assert castwise.trace.events.Origin is api.Origin and castwise.trace.events.HookChange is api.HookChange
    assert FixContext is api.FixContext


def test_make_ctx_builds_the_api_ctx_from_trace_provenance() -> None:
    w = Prov("param", "fc", None, "param fc.weight", torch.float32)
    x = Prov("input", "", None, "input x", torch.bfloat16)
    ctx = make_ctx(
        phase="forward",
        module="fc",
        op="aten.mm",
        kind=None,
        text="expected both operands to have the same dtype",
        dtypes=(torch.bfloat16, torch.float32),
        provs=(x, w),
        culprits=[1],  # the table blames the f32 weight
        is_fast=False,
        autocast=None,
        compute=torch.bfloat16,
        expected=None,
        device=CPU,
    )
    assert isinstance(ctx, api.Ctx)
    assert ctx.first is w and ctx.got == "f32" and ctx.comp == "bf16"
    assert ctx.origin == api.Origin("fc", None, "param fc.weight")
    diag = ctx.diag("CW102", "m", "f")
    assert isinstance(diag, api.Diag) and diag.culprit_modules == ("fc",)


def test_fix_context_collects_pins_the_audit_turns_into_policy_rules() -> None:
    fx = api.FixContext(torch.bfloat16, existing=(("a.norm", torch.float32, "keep"),))
    finding = Finding("CW102", "m", module="blocks.0.norm", details=(("culprit_modules", ["blocks.0.norm"]),))
    assert _fixes.keep_module_fix(castwise.Policy.parse("bf16-mixed"), finding, fx) is not None
    fx.add("a.norm", torch.float32, "keep")  # the policy has it already
    fx.add("*", torch.float32, "keep")  # never the whole model
    assert fx.rules == [("blocks.0.norm", torch.float32, "keep")]
    assert fx.culprits(finding) == ["blocks.0.norm"]
    policy = castwise.Policy.parse("bf16-mixed").with_rules(*(castwise.policy.ModuleRule(*p) for p in fx.rules))
    assert str(policy) == "bf16-mixed,keep[blocks.0.norm]=f32"


def test_a_finding_about_the_compiled_run_alone_is_typed_and_says_so_in_json() -> None:
    f = Finding("CW902", "stopped", compiled_only=True)
    assert f.to_dict()["run"] == "compiled"
    assert "run" not in Finding("CW902", "stopped").to_dict()
