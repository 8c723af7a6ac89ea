"""The suggested policy: candidate fixes from the findings' rules, each verified by a re-audit."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from castwise._dtypes import is_low
from castwise.auditor.context import FixContext, RunRecord
from castwise.auditor.session import dominant_dtype, run_request
from castwise.errors import CastwiseError
from castwise.policy import ModuleRule, Policy
from castwise.report import Finding, Report
from castwise.rules import audit as audit_rules
from castwise.rules.audit._text import true_preset
from castwise.run import RunRequest


def _compute_dtype(model: nn.Module, policy: Policy | None) -> torch.dtype:
    return policy.compute_dtype if policy is not None else dominant_dtype(model)


def _base_policy(policy: Policy | None, compute: torch.dtype) -> Policy:
    if policy is not None:
        return policy
    if is_low(compute):
        return Policy.parse(true_preset(compute))
    return Policy.parse("32-true")


def float64_modules(model: nn.Module) -> frozenset[str]:
    """The modules holding a float64 parameter of their own (a ``.double()`` left behind)."""
    return frozenset(
        name for name, m in model.named_modules() if any(p.dtype == torch.float64 for p in m.parameters(recurse=False))
    )


def fixes(policy: Policy, findings: list[Finding], compute: torch.dtype, f64: frozenset[str] = frozenset()) -> Policy:
    """One step: the policy with the fixes the error findings point at (each rule's
    ``policy_fix``). A finding whose culprit is a module left in float64 (``f64``) is fixed at
    that module instead: a float32 island there (its weights cast to float32, its output cast
    back), which no rule's own fix does (they fix where the float64 arrives)."""
    units = audit_rules.rules()
    fx = FixContext(compute, existing=tuple((r.selector, r.dtype, r.kind) for r in policy.rules))
    p = policy
    upcasters = sorted({f.module for f in findings if f.code == "CW120" and f.module}, key=len)
    for f in findings:
        f = _lifted(f, upcasters)
        rule = units.get(f.code)
        if f.level != "error" or rule is None:
            continue
        doubles = [m for m in (*fx.culprits(f), f.origin.module if f.origin else None) if m in f64]
        if doubles:
            for m in dict.fromkeys(doubles):
                fx.add(m or "", torch.float32, "keep")
        elif rule.policy_fix is not None:
            p = rule.policy_fix(p, f, fx)
    if fx.rules:
        p = p.with_rules(*(ModuleRule(*pin) for pin in fx.rules))
    return p


def suggest_policy(request: RunRequest, report: Report, runs: list[RunRecord], max_audits: int = 5) -> Policy | None:
    """A policy under which a re-audit finds no error, keeping the user's compute dtype.

    Candidates: the preset for the model's dtype (when it ran without a policy), then that with
    the fixes the findings point at, then, step by step, the fixes the re-audits' findings point
    at. Each candidate is verified by a re-audit in the user's own mode (fake or real tensors);
    the first clean one that changes what runs is returned. A candidate that only re-spells the
    user's policy (the same policy, or one under which every op runs exactly as before) is never
    returned: None when no candidate really fixes the model.
    """
    policy = request.policy
    compute = _compute_dtype(request.model, policy)
    base = _base_policy(policy, compute)
    queue: list[tuple[Policy, list[Finding]]] = []
    if policy is None:
        queue.append((base, report.findings))
    tried: set[str] = set() if policy is None else {str(policy)}
    before = _signature(runs)
    incomplete = any(f.code == "CW902" for f in report.findings)
    f64 = float64_modules(request.model)
    candidate = _safe_fixes(base, report.findings, compute, f64)
    if candidate is not None:
        queue.append((candidate, report.findings))
    audits = 0
    while queue and audits < max_audits:
        candidate, _ = queue.pop(0)
        if str(candidate) in tried or candidate == policy:
            continue
        tried.add(str(candidate))
        audits += 1
        verified, again = _verified(request, candidate, before, incomplete)
        if verified:
            return candidate
        following = _safe_fixes(candidate, again.findings, compute, f64) if again is not None else None
        if following is not None and str(following) not in tried:
            queue.append((following, again.findings if again is not None else []))
    # last: tensors made in forward with torch's default dtype (CW106 "created by aten.eye"), made
    # in the compute dtype instead (Lightning's *-true presets do so), where no module fix worked
    last = _default_dtype(base, report, compute)
    if last is not None and audits < max_audits and str(last) not in tried and last != policy:
        return last if _verified(request, last, before, incomplete)[0] else None
    return None


def _verified(
    request: RunRequest, candidate: Policy, before: list[Any], incomplete: bool
) -> tuple[bool, Report | None]:
    """Whether a re-audit under ``candidate`` finds no error and changes what runs (its report)."""
    try:
        again, again_runs = run_request(request.under(candidate))
    except CastwiseError:
        return False, None
    # a candidate whose run stops earlier than the user's (CW902) is not verified by it
    cut_short = any(f.code == "CW902" for f in again.findings) and not incomplete
    return not again.errors and not cut_short and _signature(again_runs) != before, again


def _default_dtype(base: Policy, report: Report, compute: torch.dtype) -> Policy | None:
    """``base`` with torch's default dtype set to the low compute dtype while the model runs, when
    an error is a tensor an op made in forward (not an attribute: a factory op, ``origin.op``)."""
    made = any(f.code == "CW106" and f.origin is not None and f.origin.op for f in report.errors)
    if not made or not is_low(compute) or base.default_dtype is not None:
        return None
    return base.replace(default_dtype=compute)


def _signature(runs: list[RunRecord]) -> list[Any]:
    """Every op each run traced, with its operands' dtypes: two policies with the same signature
    run the model identically (one is a no-op re-spelling of the other)."""
    return [(r.mode, r.trace.ops, r.trace.error is not None) for r in runs]


def _lifted(f: Finding, upcasters: list[str]) -> Finding:
    """The finding with each culprit inside a module that turns low-precision activations into
    float32 (a CW120 upcast) replaced by that module: the island belongs where the upcast is, not
    at the last layer inside it that made the float32."""
    details = dict(f.details)
    culprits = list(details.get("culprit_modules", ())) or ([f.origin.module] if f.origin and f.origin.module else [])
    lifted = [next((u for u in upcasters if c.startswith(u + ".")), c) for c in culprits]
    if lifted == culprits:
        return f
    details["culprit_modules"] = list(dict.fromkeys(lifted))
    return dataclasses.replace(f, details=tuple(details.items()))


def _safe_fixes(
    policy: Policy, findings: list[Finding], compute: torch.dtype, f64: frozenset[str] = frozenset()
) -> Policy | None:
    try:
        fixed = fixes(policy, findings, compute, f64)
    except CastwiseError:  # two rules that disagree on a module: not a candidate
        return None
    return None if fixed == policy else fixed


def _hooks_to_cast_back(report: Report) -> frozenset[str]:
    return frozenset(
        str(dict(f.details)["hook"]) for f in report.errors if f.code == "CW115" and "hook" in dict(f.details)
    )


def verify_code_fixes(request: RunRequest, report: Report) -> Report:
    """The hook findings' code fix (each hook's result cast back to the dtype it was given),
    simulated in a re-audit under the suggested policy (else the user's): when it finds no error,
    each such finding's ``code_fix`` says it was verified. Returns the report, updated."""
    from castwise.trace.hooks import casting_back

    names = _hooks_to_cast_back(report)
    if not names:
        return report
    under = report.suggested_policy if report.suggested_policy is not None else request.policy
    try:
        with casting_back(names):
            again, _runs = run_request(request.under(under))
    except CastwiseError:
        return report
    # a re-audit that stops earlier than the user's (CW902) does not verify it
    cut_short = any(f.code == "CW902" for f in again.findings) and not any(f.code == "CW902" for f in report.findings)
    if again.errors or cut_short:
        return report
    report.findings = [
        dataclasses.replace(f, code_fix=dataclasses.replace(f.code_fix, verified=True))
        if f.code_fix is not None and f.code == "CW115" and dict(f.details).get("hook") in names
        else f
        for f in report.findings
    ]
    return report
