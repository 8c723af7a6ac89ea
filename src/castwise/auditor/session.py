"""One audit session: the user's model copied (fake or real), the policy applied, each mode
run under the tracer, and the runs' records turned into a report by the rules."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from castwise import _autocast, devices
from castwise._compiled import CompileOptions
from castwise._dtypes import is_low, name_of, short_of
from castwise._state import preserved_state
from castwise.auditor.context import RunRecord, Session
from castwise.auditor.findings import diags_of_run, eager_only, merge, phased_diags
from castwise.policy import Policy
from castwise.report import Finding, Report, Run
from castwise.rules import audit as audit_rules
from castwise.rules.audit import cw902
from castwise.run import Inputs, RunRequest
from castwise.run.request import AUDIT_MODES
from castwise.trace import fake as fake_mod
from castwise.trace import hop, simcuda
from castwise.trace.compiled import CompiledProducer, run_compiled, warm_up
from castwise.trace.events import Mode, RunStatus, Trace
from castwise.trace.module_tree import ModuleTreeObserver
from castwise.trace.observers import default_observers
from castwise.trace.precision import PrecisionObserver
from castwise.trace.reuse import BlockReuse
from castwise.trace.reuse import enabled as reuse_enabled
from castwise.trace.tracer import Tracer, run

MODES = AUDIT_MODES


def dominant_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in, as its user set it up: the dtype most of its compute
    layers' weights are in (matrices and kernels, by size). Embedding tables and norms do not
    count: they are the layers users keep in float32 on purpose (OpenCLIP's precision="bf16" keeps
    a 49,408-row token table in f32 beside bf16 blocks, which would outweigh every block); LoRA's
    small f32 adapters weigh what they are beside a bf16 base."""
    sizes: dict[torch.dtype, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) or "norm" in type(module).__name__.lower():
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dim() >= 2:
                sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if not sizes:  # no compute layer: every floating parameter
        for p in model.parameters():
            if p.is_floating_point():
                sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    # a tie goes to float32: hand-casting goes the other way
    return max(sizes, key=lambda d: (sizes[d], d == torch.float32)) if sizes else torch.float32


# -- one run ------------------------------------------------------------------------------------


def _copies(
    model: nn.Module, inputs: Inputs, device: str, fmode: FakeTensorMode | None, memo: dict[int, torch.Tensor]
) -> tuple[nn.Module, Inputs]:
    """The run's copy of the model and of its inputs: fake tensors on ``device`` made by ``fmode``
    (``memo``: each real input's fake, by id), or real copies (``fmode`` None). The user's objects
    are only read."""
    if fmode is None:
        return fake_mod.real_model(model), inputs.real()
    return fake_mod.fake_model(model, fmode, device), inputs.fake(fmode, device, memo)


def _run_once(
    model: nn.Module,
    inputs: Any,
    policy: Policy | None,
    device: str,
    mode: Mode,
    fake: bool,
    compute: torch.dtype,
    record_ops: bool,
    observers: list[Any] | None = None,
    forced: frozenset[tuple[str, int]] = frozenset(),
    compiled: CompileOptions | None = None,
) -> RunRecord:
    """One run of ``mode`` on a copy of ``model``: the eager program under the dispatch-mode
    tracer, or (``compiled``) the graphs torch.compile makes of it, walked by the compiled producer."""
    from castwise.applied import apply

    dev = devices.get(device)
    inputs = Inputs.of(inputs)  # parsed once per request: a no-op for the request's own
    with contextlib.ExitStack() as stack:
        fmode = None
        if fake:
            # fake tensors (the audit's, and Dynamo's and AOTAutograd's) never initialise a device
            # this machine lacks, nor move a constant there for real
            stack.enter_context(simcuda.host_device_init())
            fmode = fake_mod.new_mode()
        memo: dict[int, torch.Tensor] = {}
        copy, ran = _copies(model, inputs, dev.fake_device, fmode, memo)
        result = RunRecord(mode, Trace(), compute, fake=fake, device=devices.get(device))
        # the run is defined by the policy alone, not by an autocast the caller happens to be in
        for device_type in _autocast.DEVICE_TYPES:
            stack.enter_context(_autocast.autocast(device_type, None, enabled=False))
        if fmode is not None and dev.kernels == "cuda":
            # RNNs ask the CUDA runtime whether cuDNN can run, which fails without a GPU: run them on
            # the native CUDA path, whose cells carry cuDNN's dtype contract (trace/fastpath.py)
            stack.enter_context(torch.backends.cudnn.flags(enabled=False))
            stack.enter_context(simcuda.simulated_cuda(dev))  # what model code asks torch about the GPU
        stack.enter_context(hop.dynamo_skips_restored())  # Dynamo's skip marks (eager cond, flex_attention)
        if fmode is not None:
            stack.enter_context(fake_mod.module_conversions())  # submodules re-cast inside forward
            stack.enter_context(fake_mod.scalar_formatting())  # f"expert_{idx}" on a fake index
            stack.enter_context(fake_mod.untraced_look())  # transformers' eager path, as the real run
            stack.enter_context(fmode)
        with warnings.catch_warnings():
            # a rule matching no module is reported as CW123; apply's warning would say it twice
            warnings.filterwarnings("ignore", message="castwise: rule .* matches no module")
            applied = apply(copy, policy, device=dev) if policy is not None else None
        if applied is not None:
            _record_applied(result, copy, applied)
        named_tensors = ran.named(copy)
        _describe_copy(result, copy)
        if compiled is not None:  # the graphs torch.compile runs, not the eager program
            autocast = policy.compute_dtype if policy is not None and policy.is_mixed else None
            producer = CompiledProducer(copy, dev, autocast, record_ops)
            producer.seed_inputs(named_tensors)
            result.producer = producer
            result.trace = run_compiled(producer, copy, ran.args, ran.kwargs, mode, compiled)
            return result
        chosen = (
            observers
            if observers is not None
            else [*default_observers(), ModuleTreeObserver(copy), PrecisionObserver()]
        )
        # repeated blocks traced once (fake runs): its finish splices before the others read the trace
        reuse = BlockReuse(copy) if fake and reuse_enabled() else None
        tracer = Tracer(
            copy,
            dev,
            fake=fake,
            record_ops=record_ops,
            observers=[reuse, *chosen] if reuse else chosen,
            inputs=named_tensors,
            values=[(memo[id(t)], t) for t in inputs.tensors() if id(t) in memo] if fmode is not None else (),
            forced=forced,  # branch sites answered True (the second run of a mode, trace/values.py)
        )
        result.producer = tracer
        result.trace = run(tracer, copy, ran.args, ran.kwargs, mode, engine_backward=(dev.kernels == "cpu" or not fake))
    return result


def _record_applied(result: RunRecord, copy: nn.Module, applied: Any) -> None:
    """What applying the policy did to the copy: the casts, the precision clauses declare, dtypes
    the policy did not expect."""
    from castwise.applied import iter_casts

    result.declared = declared_low(copy, applied.policy)
    result.converted = applied.policy.converted
    result.casts = [(m, n, d, _current_dtype(copy, m, n)) for m, n, d in iter_casts(applied)]
    result.unexpected = _unexpected_dtypes(copy, applied.policy, applied.decisions, result.casts)


def declared_low(model: nn.Module, policy: Policy) -> frozenset[str]:
    """The modules a ``keep[...]``/``out[...]`` rule of ``policy`` names with a 16-bit dtype (a
    keep rule: the modules inside too, which run in its island)."""
    low = [r for r in policy.rules if is_low(r.dtype)]
    if not low:
        return frozenset()
    named = list(model.named_modules())
    found = {name for name, module in named for r in low if r.matches(name, module)}
    kept = [name for name, module in named for r in low if r.kind == "keep" and r.matches(name, module)]
    inside = {name for name, _ in named for k in kept if name.startswith(k + ".") or not k}
    return frozenset(found | inside)


def _describe_copy(result: RunRecord, copy: nn.Module) -> None:
    """What the record says of the copy it ran: its parameters' dtypes, per module too."""
    for p in copy.parameters():
        key = name_of(p.dtype)
        result.param_dtypes[key] = result.param_dtypes.get(key, 0) + p.numel()
    result.dominant = dominant_dtype(copy)
    for mname, module in copy.named_modules():
        result.module_params[mname] = {n: p.dtype for n, p in module.named_parameters(recurse=False)}
    result.copy = copy


def _unexpected_dtypes(
    model: nn.Module, policy: Policy, decisions: dict[str, Any], casts: list[tuple[str, str, torch.dtype, torch.dtype]]
) -> list[tuple[str, str, str, torch.dtype, torch.dtype]]:
    """Floating parameters/buffers that, after ``apply``, are not in the dtype the policy gives
    them: what apply leaves alone (mixed policies cast nothing outside islands) in another dtype,
    e.g. a buffer cast to bf16 by hand in a model trained under bf16-mixed."""
    cast = {(m, n) for m, n, _b, _a in casts}
    out: list[tuple[str, str, str, torch.dtype, torch.dtype]] = []
    seen: set[int] = set()
    for mname, module in model.named_modules():
        island = _island_of(mname, decisions)
        for kind, store in (("param", module._parameters), ("buffer", module._buffers)):
            for tname, t in store.items():
                if t is None or id(t) in seen or not t.is_floating_point() or (mname, tname) in cast:
                    continue
                if is_traceable_wrapper_subclass(t):
                    continue  # a quantised or sharded weight (NF4, DTensor) keeps its own dtype by design
                seen.add(id(t))
                if kind == "buffer" and policy.keeps_buffer(module, tname):
                    continue  # left as the model built it, on purpose
                if kind == "param":
                    want = island or policy.param_dtype
                else:
                    want = island or (
                        policy.buffer_dtype
                        if policy.is_mixed and policy.buffer_dtype is not None
                        else policy.param_dtype
                        if policy.is_mixed
                        else policy.effective_buffer_dtype
                    )
                if t.dtype != want:
                    out.append((mname, tname, kind, t.dtype, want))
    return out


def _island_of(name: str, decisions: dict[str, Any]) -> torch.dtype | None:
    """The dtype of the innermost island that holds module ``name`` (None: no island)."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        d = decisions.get(".".join(parts[:i]))
        if d is not None and d.island is not None:
            island: torch.dtype = d.island
            return island
    return None


def _current_dtype(model: nn.Module, module: str, name: str) -> torch.dtype:
    m = model.get_submodule(module) if module else model
    t = getattr(m, name, None)
    return t.dtype if isinstance(t, torch.Tensor) else torch.float32


def _status(mode: str, findings: list[Finding], kind: str = "eager") -> RunStatus:
    """ "error" when a finding of this mode is an error, "incomplete" when the run stopped before
    the end (CW902: part of the model was not checked), else "ok". A finding about the compiled
    run alone (torch.compile stopped it) is not the eager run's."""
    here = [f for f in findings if mode in f.modes and (kind != "eager" or not f.compiled_only)]
    if any(f.level == "error" for f in here):
        return "error"
    if any(f.code == "CW902" for f in here):
        return "incomplete"
    return "ok"


def findings_of(
    runs: list[RunRecord],
    policy: Policy | None,
    alternates: list[RunRecord] | None = None,
    compiled: list[RunRecord] | None = None,
) -> list[Finding]:
    """Event checks per run (and per alternate run: the other side of its branches; per compiled
    run: the graphs torch.compile runs), merged; then every rule's run-level scan (of the eager
    runs: the scans compare modes and read what only the tracer observes)."""
    per_mode: dict[str, list[Any]] = {}
    graphs = {r.mode: r for r in compiled or []}
    for r in runs:
        # what the compiled program of this mode runs, eager refusing it, is a warning (CW125)
        seen = graphs.get(r.mode)
        per_mode.setdefault(r.mode, []).extend(diags_of_run(r) if seen is None else eager_only(phased_diags(r), seen))
    for r in alternates or []:  # the other side of a branch: the compiled run took neither
        per_mode.setdefault(r.mode, []).extend(diags_of_run(r))
    for r in compiled or []:
        c = r.trace.compiled
        # torch.compile stopped the compiled run (not a refusal the walk recorded), and eager ran
        # through: the compiled program was checked only so far; said, not passed over
        if c is not None and c.error is not None and not r.trace.events and not per_mode.get(r.mode):
            per_mode.setdefault(r.mode, []).append(cw902.compiled_stopped(c.error, c.graphs, c.fullgraph))
    for r in compiled or []:
        per_mode.setdefault(r.mode, []).extend(_compiled_only(diags_of_run(r), per_mode[r.mode]))
    findings = merge(per_mode)
    session = Session(runs, policy, list(findings))
    for rule in audit_rules.rules().values():
        if rule.scan is not None:
            findings += rule.scan(session)
    return findings


def _compiled_only(diags: list[Any], eager: list[Any]) -> list[Any]:
    """A compiled run's diagnoses of what the eager run of its mode did not diagnose: one bug is
    reported once, with the eager diagnosis (the tracer knows more of how a dtype was made: a
    forward hook's result, a custom Function), and what only the compiled graphs refuse is added."""
    seen = {m for d in eager for m in (d.module, d.origin.module if d.origin else None, *d.culprit_modules) if m}
    return [d for d in diags if not ({d.module, d.origin.module if d.origin else None, *d.culprit_modules} & seen)]


def run_audit(
    model: nn.Module,
    inputs: Any,
    policy: Policy | None,
    device: str,
    mode: str,
    fake: bool,
    *,
    record_ops: bool = True,
    observers: list[Any] | None = None,
    compiled: CompileOptions | None = None,
) -> tuple[Report, list[RunRecord]]:
    """Run every mode of the audit and build the report (no suggested policy yet). ``compiled``:
    the model is torch.compile'd with these options; each mode runs eagerly and compiled."""
    compute = policy.compute_dtype if policy is not None else dominant_dtype(model)
    inputs = Inputs.of(inputs)  # once for every run below
    modes: list[Mode] = ["train", "eval"] if mode == "both" else [mode]  # type: ignore[list-item]
    if compiled is not None:
        warm_up()  # Dynamo's tables, built before the runs patch anything they key on
    with preserved_state():
        runs = [_run_once(model, inputs, policy, device, m, fake, compute, record_ops, observers) for m in modes]
        alternates = [
            _alternate(model, inputs, policy, device, r, fake, compute, record_ops) for r in runs if r.trace.branches
        ]
        graphs = [
            _run_once(model, inputs, policy, device, m, fake, compute, record_ops, compiled=compiled)
            for m in (modes if compiled is not None else [])
        ]
    findings = findings_of(runs, policy, alternates, graphs)
    if policy is not None:
        findings += unmatched_rule_findings(policy, model, tuple(r.mode for r in runs))
    pol = None if policy is None else str(policy)
    report = Report(
        findings=findings,
        runs=[
            Run(r.mode, device, pol, _status(r.mode, findings, r.trace.kind), r.trace.kind) for r in [*runs, *graphs]
        ],
        summary={
            "params_by_dtype": dict(runs[0].param_dtypes) if runs else {},
            "activation_bytes_by_dtype": dict(runs[0].trace.activation_bytes) if runs else {},
            "ops_traced": {r.mode: len(r.trace.ops) for r in runs},
            "modules": runs[0].trace.modules if runs else [],
            **({"compiled": {r.mode: compiled_summary(r.trace) for r in graphs}} if graphs else {}),
        },
        title=f"castwise audit ({'torch.compile, ' if graphs else ''}{'fake' if fake else 'real'} tensors, "
        f"device {device}, policy {policy if policy is not None else 'none'})",
    )
    return report, runs


def run_request(request: RunRequest, *, compiled: CompileOptions | None = None) -> tuple[Report, list[RunRecord]]:
    """``run_audit`` of a checked request."""
    r = request
    return run_audit(r.model, r.inputs, r.policy, r.device, r.mode, r.fake, compiled=compiled)


def compiled_summary(trace: Trace) -> dict[str, Any]:
    """What torch.compile did in a compiled run, for the report."""
    c = trace.compiled
    if c is None:
        return {}
    return {
        "graphs": c.graphs,
        "backward_graphs": c.backward_graphs,
        "graph_breaks": [{"reason": b.reason, "count": b.count, "source": b.source} for b in c.breaks],
        "fullgraph": c.fullgraph,
        "ops_checked": c.ops,
        "error": c.error,
        "decompositions": c.decompositions,
        **({"backward_untraced": c.backward_untraced} if c.backward_untraced else {}),
    }


def _alternate(
    model: nn.Module,
    inputs: Any,
    policy: Policy | None,
    device: str,
    run: RunRecord,
    fake: bool,
    compute: torch.dtype,
    record_ops: bool,
) -> RunRecord:
    """The mode run again with every branch the first run answered False answered True, so the
    other side of each is checked too; each site records whether it was (``other_checked``)."""
    branches = run.trace.branches
    alt = _run_once(model, inputs, policy, device, run.mode, fake, compute, record_ops, forced=frozenset(branches))
    # a site the second run never reached with True (it stopped before, or took another path) is
    # unchecked; where it stopped early its own CW902 says so
    reached = alt.trace.branches
    for key, site in branches.items():
        other = reached.get(key)
        site["other_checked"] = other is not None and other["answers"][True] > 0
    return alt


def unmatched_rule_findings(policy: Policy, model: nn.Module, modes: tuple[Mode, ...] = ()) -> list[Finding]:
    """CW123 findings for the audit: one per user rule that matches no module of ``model``,
    with the suggested selectors as its fix (``details``: the rule and the suggestions)."""
    out: list[Finding] = []
    from castwise.applied.inspection import unmatched_message, unmatched_rules

    for rule, suggestions in unmatched_rules(policy, model):
        fixes = [f"{rule.kind}[{s}]={short_of(rule.dtype)}" for s in suggestions]
        fix = (
            f"replace {rule} with {' or '.join(fixes)}"
            if fixes
            else f"check the selector of {rule}: '*' is one dotted segment, '**' any number"
        )
        out.append(
            Finding(
                code="CW123",
                message=unmatched_message(rule, suggestions, model),
                modes=modes,
                fix=fix,
                details=(("rule", str(rule)), ("suggestions", fixes)),
            )
        )
    return out
