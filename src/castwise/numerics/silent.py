"""The silent-precision findings' fixes (CW140-CW149), verified on the user's real inputs.

A finding names what to change (``out[lm.lm_head]=f32``, ``keep[moe.router]=f32``, the input cast
left off: ``inputs=none``); the audit that found it ran on fake tensors, which hold no values.
Here each candidate clause is added to the user's policy and the model run for real against the
float32 reference with compare's ``ErrorOf`` (the measure CW320's island fix uses): a clause that
lowers the error ``VERIFIED_FACTOR`` times is the finding's verified fix, and the one fix of every
other finding that names it (one narrowed table or one engine cast behind several findings). A
clause the model cannot run with (float32 inputs into 16-bit weights once the input cast is off)
is repaired by the audit's own suggested policy for it, then measured. None verified: the finding
says so, with the best measured.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from castwise._dtypes import is_low
from castwise.auditor.entry import NOT_VERIFIED, SILENT
from castwise.errors import CastwiseError
from castwise.numerics._compare_fix import VERIFIED_FACTOR, ErrorOf, IslandFix, verifier
from castwise.numerics._compare_target import Target, _literal, parse_target
from castwise.numerics._failed import RunRaised
from castwise.policy import ModuleRule, Policy, grammar
from castwise.policy import fields as policy_fields
from castwise.report import Finding, Report
from castwise.run import Inputs
from castwise.trace.source import where

MAX_RUNS = 8  # real re-runs of the policy spent on candidates, all findings together
REFERENCE = "32-true"


@dataclass(frozen=True)
class FixCheck(IslandFix):
    """One candidate clause (``selector``: "out[lm.lm_head]=f32", a repaired policy's islands too)
    and what it did to the error, in a real run with it alone."""

    @property
    def clause(self) -> str:
        return self.selector

    def text(self, covers: int = 1) -> str:
        times = "inf" if math.isinf(self.reduction) else f"{self.reduction:.1f}"
        line, clause = split_code(self.clause)
        if line is not None:
            how = (
                f"the code change (the cast to 16-bit at {line} left out, `{clause}`): {self.metric} error "
                f"against float32 {self.before:.2e} -> {self.after:.2e}, {times}x lower, in a real run on your "
                "inputs with that cast left out"
            )
            if self.verified:
                many = f"; one fix for the {covers} findings of this cause" if covers > 1 else ""
                return f"Verified: {how}{many}."
            return f"Not verified: {how} (under the {VERIFIED_FACTOR:.0f}x asked)."
        how = (
            f"`{self.clause}`: {self.metric} error against float32 {self.before:.2e} -> {self.after:.2e}, "
            f"{times}x lower, in a real run on your inputs with it alone"
        )
        if self.verified:
            many = f"; one fix for the {covers} findings of this cause" if covers > 1 else ""
            return f"Verified: {how}{many}."
        return (
            f"Not verified: the best policy clause tried is {how} (under the {VERIFIED_FACTOR:.0f}x asked); "
            "make the code change above."
        )


def with_clause(policy: Policy, clause: str) -> Policy:
    """``policy`` with one more clause (a ``keep[...]``/``out[...]`` rule or a field, ``inputs=none``)."""
    parsed = grammar.read(clause)
    changes: dict[str, Any] = {}
    for key, value in parsed.given.items():
        field = policy_fields.by_clause(key)
        if field is None or key in ("params", "compute"):
            raise CastwiseError(
                f"clause {clause!r} cannot be added to a policy (it would change its dtypes); valid: "
                "inputs=none, keep[SELECTOR]=DT, out[SELECTOR]=DT, output=DT"
            )
        changes[field.attr] = field.parse(value)
    return policy.replace(**changes).with_rules(*parsed.rules)


ISLAND_SHARE = 0.25  # the most of the model's parameters an island tried beyond the rule's own clause holds


def candidates(f: Finding, policy: Policy, model: nn.Module | None = None) -> list[str]:
    """The clauses that may fix ``f``, its rule's own first, then an island at its module and at its
    origin: only a small one (``ISLAND_SHARE`` of the parameters at most), lest "verified" mean no
    more than most of the model run in float32."""
    own = dict(f.details).get("fix_policy")
    out = [own] if isinstance(own, str) else list(own or ())
    for module in (f.module, f.origin.module if f.origin else None):
        if module and (model is None or _share(model, module) <= ISLAND_SHARE):
            out.append(f"keep[{_literal(module)}]=f32")
    tensor = f.origin.tensor if f.origin is not None else None
    if tensor and tensor.startswith("input ") and policy.input_dtype is not None:
        out.append("inputs=none")  # the engine's input cast narrowed it: leave the inputs as given
    if f.source and f.origin is not None and f.origin.op in CASTS and f.origin.module:
        # the model narrows in its own code: the code change, emulated (that cast left out), with
        # its module in float32 so the wider value meets float32 weights there
        out.append(f"{LEAVE_OUT}{f.source}{CODE_SEP}keep[{_literal(f.origin.module)}]=f32")
    return list(dict.fromkeys(out))


LEAVE_OUT = "leave out the cast at "  # a candidate that is a code change, not a policy clause
CODE_SEP = " with "
CASTS = ("aten._to_copy", "aten.to", "aten.type_as")


class LeftOut(TorchDispatchMode):
    """Runs the model as if the 16-bit cast of a float32 tensor at ``source`` ("models/dit.py:42",
    the user's line) were not in its code: that ``_to_copy`` returns its input. Only casts are
    looked at, and the stack only for a float32-to-16-bit one."""

    def __init__(self, source: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.source, self.hits = source, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            dtype = kwargs.get("dtype")
            if args[0].dtype == torch.float32 and dtype is not None and is_low(dtype) and where() == self.source:
                self.hits += 1
                return args[0].clone()
        return func(*args, **kwargs)


def split_code(candidate: str) -> tuple[str | None, str]:
    """A candidate's code change (the line whose cast is left out, or None) and its policy clause."""
    if not candidate.startswith(LEAVE_OUT):
        return None, candidate
    line, _, clause = candidate[len(LEAVE_OUT) :].partition(CODE_SEP)
    return line, clause


def _share(model: nn.Module, name: str) -> float:
    """The share of the model's parameters in module ``name`` and inside it (1: not found)."""
    try:
        inside = sum(p.numel() for p in model.get_submodule(name).parameters())
    except AttributeError:
        return 1.0
    return inside / max(sum(p.numel() for p in model.parameters()), 1)


def _fix_text(f: Finding) -> str:
    """The finding's fix as its rule wrote it (without the audit's "not verified" note)."""
    return (f.fix or "").split(NOT_VERIFIED)[0]


def _unverified(f: Finding, why: str) -> Finding:
    details = {**dict(f.details), "fix_verified": False, "fix_check": why}
    fix = f"{_fix_text(f)}{NOT_VERIFIED}{why}.)" if f.fix else None
    return dataclasses.replace(f, fix=fix, details=tuple(details.items()))


def _checked(f: Finding, check: FixCheck, covers: int) -> Finding:
    times = "inf" if math.isinf(check.reduction) else float(f"{check.reduction:.4g}")
    line, clause = split_code(check.clause)
    details = {
        **dict(f.details),
        "fix_verified": check.verified,
        "fix_policy": clause,
        **({"fix_code": f"leave out the cast at {line}"} if line is not None else {}),
        "error_reduction": times,
        "error_before": check.before,
        "error_after": check.after,
    }
    details.pop("fix_check", None)
    return dataclasses.replace(f, fix=f"{_fix_text(f)} {check.text(covers)}", details=tuple(details.items()))


def fake_only(model: nn.Module, inputs: Inputs) -> str | None:
    """Why the model cannot be run for real here (meta or fake weights or inputs), or None."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [*model.parameters(), *model.buffers(), *inputs.tensors()]
    if any(t.is_meta or isinstance(t, FakeTensor) for t in tensors):
        return "the model or its inputs are fake or on the meta device, so nothing can be run on values"
    return None


class _Search:
    """The candidates' real runs, shared by every finding: a clause is run once."""

    def __init__(
        self,
        errors: ErrorOf,
        base: Policy,
        recipe: Any,
        repair: Callable[[Policy], Policy | None],
        fresh: Callable[[], ErrorOf] | None = None,
    ):
        self.errors, self.base, self.recipe, self.repair = errors, base, recipe, repair
        self.fresh = fresh  # a new ErrorOf, its float32 reference run under the modes then active
        self.before = errors.of(Target(base, recipe))
        self.tried: dict[str, FixCheck | None] = {}

    def check(self, clause: str) -> FixCheck | None:
        if clause not in self.tried:
            self.tried[clause] = self._run(clause) if self.errors.runs < MAX_RUNS else None
        return self.tried[clause]

    def _run(self, candidate: str) -> FixCheck | None:
        line, clause = split_code(candidate)
        try:
            policy = with_clause(self.base, clause)
        except CastwiseError:
            return None
        if line is not None:
            if self.fresh is None:
                return None
            # the float32 reference is the code without that cast too (the model's own cast runs
            # under any policy): both the policy and the fix are measured against it
            left = LeftOut(line)
            try:
                with left:
                    errors = self.fresh()
                before = errors.of(Target(self.base, self.recipe))
                with left:
                    after = errors.of(Target(policy, self.recipe))
            except RunRaised:
                return None
            # no cast met at that line in the real run: nothing was emulated, nothing verified
            return FixCheck(candidate, (), before, after, errors.metric) if left.hits else None
        try:
            after = self.errors.of(Target(policy, self.recipe))
        except RunRaised:
            # it does not run as is (float32 inputs into 16-bit weights): float32 islands where the
            # audit finds it fails, and the clause is measured against those islands alone
            repaired = self.repair(policy)
            if repaired is None:
                return None
            islands = [r for r in repaired.rules if r not in policy.rules]
            try:
                after = self.errors.of(Target(repaired, self.recipe))
                # what the clause itself does: against the islands alone (they run more in float32)
                before = self.errors.of(Target(self.base.with_rules(*islands), self.recipe))
            except RunRaised:
                return None
            return FixCheck(",".join([clause, *map(str, islands)]), (), before, after, self.errors.metric)
        return FixCheck(clause, (), self.before, after, self.errors.metric)


def verify_fixes(
    model: Any, inputs: Any, report: Report, *, policy: Any, mode: str = "train", device: str | None = None
) -> Report:
    """``report`` with each CW140-CW149 finding's fix verified on real tensors: its fix says
    "Verified" with the error before and after (``details``: ``fix_verified``, ``fix_policy``,
    ``error_reduction``) or "Not verified" and why. ``policy``: the policy the audit ran under."""
    silent = [i for i, f in enumerate(report.findings) if f.code in SILENT]
    if not silent:
        return report
    from castwise.auditor import preserved_state
    from castwise.numerics._run import check_args

    why = fake_only(model, Inputs.of(inputs)) if isinstance(model, nn.Module) else None
    if why is None and policy is None:
        why = "the audit ran without a policy, and a fix is a clause added to one"
    if why is not None:
        for i in silent:
            report.findings[i] = _unverified(report.findings[i], why)
        return report
    # the runs are on this machine, where the model is; ``device`` is the audit's target (repairs)
    request = check_args("verify_fixes", model, inputs, policy, None, mode)
    assert request.policy is not None  # checked above
    with preserved_state():
        checks = _search(request.model, request.inputs, request.policy, request.mode, report, silent, device)
    for i in silent:
        found = checks.get(i)
        if found is None:
            report.findings[i] = _unverified(
                report.findings[i],
                f"no candidate clause ran under the policy, or the {MAX_RUNS} re-runs went to other findings",
            )
        else:
            covers = sum(1 for c in checks.values() if c is found)
            report.findings[i] = _checked(report.findings[i], found, covers)
    return report


def _search(
    model: nn.Module, inputs: Inputs, policy: Policy, mode: str, report: Report, silent: list[int], device: str | None
) -> dict[int, FixCheck]:
    """Each finding's fix: the first of its candidates that verifies (one run per clause, shared),
    else the best one measured."""
    target, ref = parse_target(_wide_outputs(policy)), parse_target(REFERENCE)
    errors = verifier(model, inputs, target, ref, mode, None)

    def repair(p: Policy) -> Policy | None:
        return _repaired(model, inputs, p, device, mode)

    search = _Search(
        errors, target.policy, target.recipe, repair, lambda: verifier(model, inputs, target, ref, mode, None)
    )
    found: dict[int, FixCheck] = {}
    for i in silent:
        found_i = _fix_of(search, candidates(report.findings[i], target.policy, model))
        if found_i is not None:
            found[i] = found_i
    return found


REPAIR_ROUNDS = 6  # fake audits spent making a clause's policy run (an audit stops at its first error)


def _repaired(model: nn.Module, inputs: Inputs, policy: Policy, device: str | None, mode: str) -> Policy | None:
    """``policy`` made to run, the clause kept: each module the audit finds an error at (float32
    inputs meeting 16-bit weights once the input cast is off) made a float32 island, which casts
    its inputs in and its output back. The audit's own suggested policy would undo the clause."""
    from castwise.auditor import audit

    for _ in range(REPAIR_ROUNDS):
        try:
            again = audit(model, inputs, policy=policy, device=device, mode=mode)
        except CastwiseError:
            return None
        modules = [f.module for f in again.errors if f.module]
        if not again.errors:
            return policy
        if len(modules) < len(again.errors):
            return None  # an error no island can take (at the model's own top level)
        policy = policy.with_rules(*(ModuleRule(_literal(m), torch.float32) for m in dict.fromkeys(modules)))
    return None


def _wide_outputs(policy: Policy) -> Policy:
    """The policy with the model's outputs returned as computed (``output=f32``), in every run here:
    a 16-bit output cast rounds every result alike, policy and fix, at the 16-bit spacing, hiding
    the error the fix removes below it; FSDP2, DeepSpeed and Lightning's ``*-true`` return the
    outputs uncast (or in float32)."""
    wide = policy.output_dtype is not None and is_low(policy.output_dtype)
    return policy.replace(output_dtype=torch.float32) if wide else policy


def _fix_of(search: _Search, clauses: list[str]) -> FixCheck | None:
    """A clause already verified for another finding first (one cause, one fix), then each
    candidate in order until one verifies; none: the best measured."""
    for clause in clauses:
        done = search.tried.get(clause)
        if done is not None and done.verified:
            return done
    tried: list[FixCheck] = []
    for clause in clauses:
        check = search.check(clause)
        if check is not None and check.verified:
            return check
        tried += [check] if check is not None else []
    return max(tried, key=lambda c: c.reduction) if tried else None


def silent_islands(model: nn.Module, inputs: Inputs, policy: Policy, mode: str) -> list[str]:
    """The modules the silent findings of a fake audit under ``policy`` make float32 islands
    (their ``keep[...]=f32`` clauses, each module it selects): where tune starts. Others (an
    ``out[...]`` or ``inputs=`` clause) are no island; a policy the audit refuses has none."""
    from castwise.auditor import audit

    try:
        report = audit(model, inputs, policy=policy, mode=mode)
    except CastwiseError:
        return []
    rules = []
    for f in report.findings:
        clause = dict(f.details).get("fix_policy") if f.code in SILENT else None
        if isinstance(clause, str):
            try:
                rules += [r for r in grammar.read(clause).rules if r.kind == "keep" and not is_low(r.dtype)]
            except CastwiseError:
                continue
    named = list(model.named_modules())
    return list(dict.fromkeys(name for r in rules for name, module in named if name and r.matches(name, module)))


__all__ = ["SILENT", "FixCheck", "candidates", "silent_islands", "verify_fixes", "with_clause"]
