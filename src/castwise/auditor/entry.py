"""The audit of a checked request, and of a distributed setup: castwise.distributed.audit builds
the view of the sharded (or planned) model and reads its units; the view is audited as any request."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from castwise import _releases as releases
from castwise import devices
from castwise._autocast import emulated
from castwise._compiled import CompileOptions
from castwise.auditor.context import RunRecord
from castwise.auditor.offered import check_offered
from castwise.auditor.session import run_request
from castwise.auditor.suggest import suggest_policy, verify_code_fixes
from castwise.distributed.audit import candidate, finish, prepare
from castwise.ledger.runtime import audit_ledger
from castwise.policy import Policy
from castwise.report import Report
from castwise.run import RunRequest, check, model_device


def audited(request: RunRequest, compiled: CompileOptions | None = None) -> Report:
    """The audit of a checked request: its runs, and where they found an error the suggested
    policy and the fixes offered, each verified by a re-audit."""
    with emulated(request.torch_release):  # every run below, re-audits too, as that release
        report, runs = run_request(request, compiled=compiled)
        report = unverified_silent(report, request.fake)
        if request.step is not None:  # the optimizer step after the train run's backward
            report = with_ledger(report, request, runs)
        if report.errors:  # an incomplete run alone has nothing for a policy to fix
            report.suggested_policy = suggest_policy(request, report, runs)
            report = verify_code_fixes(request, report)
        return _release_causes(check_offered(request, report, runs), request)


SILENT = frozenset(f"CW{n}" for n in range(140, 150))  # the silent-precision codes
NOT_VERIFIED = " (Not verified: "


def unverified_silent(report: Report, fake: bool) -> Report:
    """The silent-precision findings' fixes are verified only by a real run against float32 (their
    error is a value, not a dtype), which the audit does not make: each says so, and how."""
    ran = "ran on fake tensors, which hold no values" if fake else "measures dtypes, not values"
    why = (
        f"the audit {ran}; `castwise audit --real` or castwise.numerics.silent.verify_fixes(model, inputs, "
        "report, policy=...) runs the fix against float32 on your inputs"
    )
    report.findings = [
        replace(
            f,
            fix=f"{f.fix}{NOT_VERIFIED}{why}.)" if f.fix else f.fix,
            details=(*f.details, ("fix_verified", False), ("fix_check", why)),
        )
        if f.code in SILENT
        else f
        for f in report.findings
    ]
    return report


def with_ledger(report: Report, request: RunRequest, runs: list[RunRecord]) -> Report:
    """The report with the ledger of the user's optimizer, stepped after the train run (its
    copy, its gradients), and the ledger's findings."""
    assert request.step is not None
    train = next((r for r in runs if r.mode == "train"), None)
    ledger = audit_ledger(
        request.model, request.step, train.copy if train is not None else None, not request.fake, "the audit"
    )
    report.findings.extend(ledger.findings)
    report.extra["ledger"] = ledger.to_dict()
    return report


def _release_causes(report: Report, request: RunRequest) -> Report:
    """A finding whose op (or its origin's) got its autocast category with a recorded release
    says so: "since torch 2.12, rms_norm runs in f32 under CUDA autocast"."""
    if request.policy is not None and request.policy.autocast_dtype is None:
        return report  # no autocast in the run: its lists cause nothing
    release = request.torch_release or releases.release_of(torch.__version__)
    kind = devices.get(request.device).fake_device
    for i, f in enumerate(report.findings):
        note = releases.cause_note((f.origin.op if f.origin else None, f.op), kind, release)
        if note is not None:
            report.findings[i] = replace(f, message=f"{f.message} ({note})")
    return report


def audit_sharded(
    model: nn.Module,
    inputs: Any,
    *,
    policy: Policy | str | None = None,
    device: str | None = None,
    mode: str = "both",
    fake: bool = True,
    world_size: int | None = None,
    units: list[str] | None = None,
    verify: bool = True,
    torch: str | None = None,
) -> Report:
    """Audit a distributed setup on fake tensors: ``model`` sharded by FSDP2 (its units are read
    from its FSDP states; ``policy`` must be None or the policy it was sharded with), or an
    unsharded ``model`` with the ``policy`` that ``castwise.fsdp2.fully_shard`` would apply
    (its plan, ``units`` as there). ``world_size``: ranks the parameters are sharded over, for
    the per-rank bytes (default: the sharded model's mesh size, else 1).

    Returns a ``Report`` with the findings of the computation the units do and
    ``to_dict()["units"]``: per unit the dtypes it stores, gathers, computes, reduces and outputs in.
    Its ``suggested_policy``, when there is one, is for ``castwise.fsdp2.fully_shard`` (a re-audit of
    its plan finds no error); ``verify=False`` skips looking for one. ``torch``: a recorded torch
    release whose autocast the units run under, as in ``castwise.audit``.
    """
    sharded = prepare(model, policy, world_size, units, fake)
    request = check(
        "audit",
        sharded.view,
        inputs,
        policy=sharded.policy,
        device=device or model_device(model),
        mode=mode,
        torch_release=torch,
    )
    report = finish(model, sharded, audited(request))
    found, report.suggested_policy = report.suggested_policy, None
    plan = sharded.setup.plan
    again = candidate(plan.policy, found) if found is not None and plan is not None and verify else None
    if again is not None:  # kept when a re-audit of its plan finds no error
        verified = audit_sharded(
            sharded.view,
            request.inputs,
            policy=again,
            device=request.device,
            mode=mode,
            verify=False,
            torch=request.torch_release,
        )
        report.suggested_policy = again if verified.ok else None
    return report


def release_changes(request: RunRequest, before: str, after: str) -> dict[str, Any]:
    """Every module whose dtype flow (its inputs' and outputs' dtypes) differs between autocast
    as torch ``before`` and as torch ``after`` ran it: one forward (eval) run under each release,
    the flow a module hands on being set there (backward follows its dtypes), no fix search."""
    flows = []
    for release in (before, after):
        with emulated(release):
            report, _ = run_request(replace(request, mode="eval", torch_release=release))
        flows.append({m["name"]: m for m in report.summary.get("modules", [])})
    old, new = flows
    modules = [
        {
            "module": name or "(root)",
            "type": new[name]["type"],
            before: {"inputs": old[name]["inputs"], "outputs": old[name]["outputs"]},
            after: {"inputs": new[name]["inputs"], "outputs": new[name]["outputs"]},
        }
        for name in new
        if name in old and (old[name]["inputs"], old[name]["outputs"]) != (new[name]["inputs"], new[name]["outputs"])
    ]
    kind = devices.get(request.device).fake_device
    lists = releases.load(before).changed(releases.load(after), kind)
    return {"device": request.device, "releases": [before, after], "modules": modules, "autocast": lists}
