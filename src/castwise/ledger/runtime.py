"""The ledger of a run (imports torch): the audit's optimizer step, and the steps a script takes
under ``castwise run``.

The audit steps after the backward it already ran: on a real run, on that run's own copy with its
own gradients (CW150 is then measured for any optimizer); on a fake run, the gradients' dtypes are
the run's and the step runs on a twin of the model as the run had it (the policy's dtypes) holding
a sample of the user's weights (the first rows, up to ``SAMPLE`` elements a parameter; a meta
model stays on meta: dtypes without values).

Under ``castwise run`` the global optimizer-step hooks read the script's own first steps of each
optimizer (nothing of them changes): before the first, a sample of each 16-bit parameter and its
state, from which an f32 twin takes the same steps with the sampled gradients of each of the
first ``STALL_STEPS`` steps (CW150, CW153: the stored samples against the twin's after them);
after the first, the state the optimizer made (the ledger) and a resume of it (CW151 on the sample). Until the second
step, a tensor hook on each 16-bit parameter sums a sample of its micro-batches' gradients in f32,
which the gradient torch summed in 16 bits is measured against (CW152).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from castwise._dtypes import name_of, short_of
from castwise.errors import AuditError
from castwise.ledger.checks import F32Twin, kept_rows, resume_findings, step_findings, update_findings
from castwise.ledger.contracts import contract_findings, mixes_dtypes, raised_ledger
from castwise.ledger.fsdp import reduce_dtypes
from castwise.ledger.model import OptimizerSpec, keeps_precision, ledger_of, row_entries, spec_of, step_copy
from castwise.ledger.values import Entry, Ledger, group_rows
from castwise.rules.api import Finding

__all__ = ["SAMPLE", "STALL_STEPS", "StepProbe", "audit_ledger", "sampled", "step_spec", "watch_steps"]

SAMPLE = 4096  # elements of a parameter the checks step on (whole rows, at least one)
# the script's steps CW150 measures: the gap after 4 steps was within 0.02 of the 20-step truth on
# every parameter of benchmarks/bench_ledger_runtime.py but one (0.04); 1 step's: up to 0.24 off
STALL_STEPS = 4
_LOW = (torch.bfloat16, torch.float16)


def _rows(t: torch.Tensor, limit: int = SAMPLE) -> torch.Tensor:
    """The first rows of ``t`` holding at most ``limit`` elements (one row at least); of a sharded
    DTensor, this rank's own shard (slicing the DTensor itself could run a collective on one rank)."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        t = to_local()
    if t.dim() == 0 or t.numel() <= limit:
        return t
    per_row = max(1, t.numel() // t.shape[0])
    return t[: max(1, limit // per_row)]


def sampled(model: nn.Module, dtypes: Mapping[str, torch.dtype], limit: int = SAMPLE) -> nn.Module:
    """A twin of ``model`` whose parameters are the first rows of the user's (at most ``limit``
    elements each), in ``dtypes[name]`` (the run's, after the policy); a meta model stays meta.
    The user's tensors are only read."""
    memo: dict[int, Any] = {}
    for n, p in model.named_parameters():
        dtype = dtypes.get(n, p.dtype)
        if p.device.type == "meta":
            t = torch.empty(p.shape, dtype=dtype, device="meta")
        else:
            t = _rows(p.detach(), limit).to(dtype=dtype, copy=True)
        twin = nn.Parameter(t, requires_grad=p.requires_grad)
        dt = getattr(p, "grad_dtype", None)
        if isinstance(dt, torch.dtype) and dt != p.dtype:
            twin.grad_dtype = dt
        memo[id(p)] = twin
    return copy.deepcopy(model, memo)


def audit_ledger(model: nn.Module, spec: OptimizerSpec, run_copy: nn.Module | None, real: bool, source: str) -> Ledger:
    """The ledger of the audit's train run: its copy (``run_copy``, after backward) and the user's
    optimizer (``spec``), with CW150 / CW151 measured on the step."""
    params = dict(run_copy.named_parameters()) if run_copy is not None else dict(model.named_parameters())
    grads_dt = {n: p.grad.dtype for n, p in params.items() if p.grad is not None}
    declared = {  # the user's grad_dtype where it differs from the parameter's (torch's default: the same)
        n: dt
        for n, p in model.named_parameters()
        if isinstance(dt := getattr(p, "grad_dtype", None), torch.dtype) and dt != p.dtype
    }
    grads_dt.update({n: dt for n, dt in declared.items() if n in grads_dt})  # (a copy may not carry grad_dtype)
    if mixes_dtypes(params, grads_dt) and (contract := contract_findings(spec, params, grads_dt, declared)):
        return raised_ledger(spec, params, grads_dt, source, contract)
    alias: dict[str, str] = {}
    try:
        if real and run_copy is not None:
            # the run's own copy and gradients: the step the user's next optimizer.step() takes
            grads = {n: p.grad for n, p in run_copy.named_parameters() if p.grad is not None}
            result = step_copy(run_copy, spec, grads=grads, in_place=True)
            measured = True
        else:
            twin = sampled(model, {n: p.dtype for n, p in params.items()})
            alias = _representatives(twin, spec, grads_dt) if _on_meta(twin) else {}
            stepped = _only(spec, set(alias.values())) if alias else spec
            result = step_copy(twin, stepped, grad_dtypes=grads_dt, in_place=True)
            measured = False
    except (RuntimeError, TypeError) as exc:
        contract = contract_findings(spec, params, grads_dt, declared)
        if not contract:
            raise AuditError(f"the optimizer step on the model's copy raised {type(exc).__name__}: {exc}") from exc
        return raised_ledger(spec, params, grads_dt, source, contract)
    ledger = ledger_of(result, spec, source, alias if not real else None)
    found = (
        *update_findings(model, spec, result, measured=measured, keep=kept_rows(ledger)),
        *resume_findings(result),
    )
    return dataclasses.replace(ledger, findings=found)


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def _representatives(model: nn.Module, spec: OptimizerSpec, grad_dtypes: Mapping[str, torch.dtype]) -> dict[str, str]:
    """On meta (dtypes, no values: a 7B): each parameter -> the one that steps for it, the first of
    its kind. What an optimizer allocates is decided per param group by the parameter's dtype, its
    gradient's, its number of dimensions (Adafactor factors matrices) and whether it is small
    (bitsandbytes / torchao keep tensors under 4096 elements in full precision)."""
    first: dict[tuple[Any, ...], str] = {}
    alias = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            key = (spec.group_of(n), p.dtype, grad_dtypes.get(n), p.dim(), p.numel() >= SAMPLE)
            alias[n] = first.setdefault(key, n)
    return alias


def _only(spec: OptimizerSpec, names: set[str]) -> OptimizerSpec:
    return OptimizerSpec(spec.cls, tuple((tuple(n for n in ns if n in names), kw) for ns, kw in spec.groups))


@dataclass
class _Seen:
    """What the probe keeps of one optimizer between its steps."""

    spec: OptimizerSpec
    start: dict[str, torch.Tensor] = field(default_factory=dict)  # samples before the first step, by name
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # the samples' gradients of the next step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # the script's own, by name
    twin: F32Twin | None = None  # the same steps in f32 on the samples
    ref: dict[str, torch.Tensor] = field(default_factory=dict)  # the twin's weights after the steps so far
    keep: frozenset[str] = frozenset()  # rows keeping precision by design
    steps: int = 0
    done: bool = False  # reported
    sums: dict[str, _Sum] = field(default_factory=dict)  # each 16-bit gradient's micro-batches, summed in f32
    hooks: list[Any] = field(default_factory=list)


@dataclass
class StepProbe:
    """Reads each optimizer's first ``STALL_STEPS`` steps of a script (the global step hooks);
    ``names`` gives a parameter's name from the script's models (else ``group{i}.{j}``);
    ``on_ledger`` sees each optimizer's ledger (findings in it) after those steps, or at the end
    of the run."""

    names: Callable[[torch.Tensor], str | None] = lambda p: None
    on_ledger: Callable[[Ledger], None] | None = None
    modules: Callable[[], Iterable[nn.Module]] = lambda: ()  # the script's models (FSDP2's reduce dtypes)
    ledgers: list[Ledger] = field(default_factory=list)
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _pending: dict[int, Ledger] = field(default_factory=dict)
    _busy: bool = False  # the probe's own f32 and resume steps: not the script's

    def _named(self, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, g in enumerate(opt.param_groups):
            for j, p in enumerate(g["params"]):
                name = self.names(p)  # (two models' parameters of one name: the second by its place)
                out[name if name is not None and name not in out else f"group{i}.{j}"] = p
        return out

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._busy:
            return
        seen = self._seen.get(id(opt))
        if seen is None:
            seen = self._seen[id(opt)] = self._first_seen(opt)
            self._check_contract(opt, seen)
        if seen.done:
            return
        if seen.steps == 1:
            self._count_micro_batches(opt, seen)
        if seen.twin is not None:
            with torch.no_grad():
                seen.grads = {
                    n: _rows(p.grad.detach()).clone()
                    for n, p in seen.params.items()
                    if n in seen.twin.params and p.grad is not None
                }

    def _check_contract(self, opt: torch.optim.Optimizer, seen: _Seen) -> None:
        """Before the first step: where a gradient's dtype differs from its parameter's, the step on a
        sample; one that raises is reported now (CW154), before the script's own step raises it."""
        grads = {n: p.grad.dtype for n, p in seen.params.items() if p.grad is not None}
        if not mixes_dtypes({n: seen.params[n] for n in grads}, grads):
            return
        self._busy = True
        try:
            found = contract_findings(seen.spec, seen.params, grads)
        finally:
            self._busy = False
        if found:
            self._pending[id(opt)] = raised_ledger(seen.spec, seen.params, grads, "the script's step", found)
            self._report_pending(id(opt), seen)

    def _first_seen(self, opt: torch.optim.Optimizer) -> _Seen:
        params = self._named(opt)
        by_id = {id(p): n for n, p in params.items()}
        groups = tuple(
            (tuple(by_id[id(p)] for p in g["params"]), {k: v for k, v in g.items() if k != "params"})
            for g in opt.param_groups
        )
        seen = _Seen(OptimizerSpec(type(opt), groups), params=params)
        states = {}
        with torch.no_grad():
            for n, p in params.items():
                state = _sampled_state(opt.state.get(p, {}), p)
                if p.dtype in _LOW and p.grad is not None and p.device.type != "meta" and state is not None:
                    seen.start[n] = _rows(p.detach()).clone()
                    states[n] = state
        if seen.start:
            self._busy = True  # (building an optimizer runs no step; its state is loaded as the script's)
            try:
                seen.twin = F32Twin(seen.spec, seen.start, states)
            finally:
                self._busy = False
        return seen

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        seen = None if self._busy else self._seen.get(id(opt))
        if seen is None or seen.done:
            return
        seen.steps += 1
        self._busy = True
        try:
            if seen.twin is not None:
                seen.ref = seen.twin.step(seen.grads)
            if seen.steps == 1:
                self._pending[id(opt)] = self._first_step(opt, seen)
        finally:
            self._busy = False
        if self._broke(seen) or seen.steps == STALL_STEPS:
            self._report_pending(id(opt), seen)  # (NaN weights: the next steps' gradients say nothing)
        elif seen.steps == 1:
            for n, p in seen.params.items():  # the micro-batches each 16-bit gradient sums, summed again in f32
                sharded = callable(getattr(p, "to_local", None))  # (FSDP2's .grad: the reduced shard, no sum)
                if (
                    p.dtype in _LOW
                    and p.requires_grad
                    and not sharded
                    and getattr(p, "grad_dtype", None) in (None, p.dtype)
                ):
                    seen.sums[n] = _Sum(p)
                    seen.hooks.append(p.register_hook(seen.sums[n].add))  # type: ignore[no-untyped-call]

    @staticmethod
    def _broke(seen: _Seen) -> bool:
        """Whether a stored sample went NaN/Inf where the f32 twin's stays finite."""
        return any(
            bool((~torch.isfinite(_rows(seen.params[n].detach())) & torch.isfinite(r)).any())
            for n, r in seen.ref.items()
        )

    def _first_step(self, opt: torch.optim.Optimizer, seen: _Seen) -> Ledger:
        spec, who = seen.spec, f"{seen.spec.name.rsplit('.', 1)[-1]} (the script's step)"
        per = [(n, row_entries(n, p, opt, None, who)) for n, p in seen.params.items()]
        for _, e in per:
            e.pop("checkpoint_save")
            e.pop("checkpoint_load")
        reduced = reduce_dtypes(self.modules())
        for n, e in per:
            if id(seen.params[n]) in reduced:
                e["reduction"] = Entry(name_of(reduced[id(seen.params[n])][1]), "FSDP2 MixedPrecisionPolicy")
        ledger = Ledger(group_rows(per), f"the script's {spec.name}")
        seen.keep = frozenset(n for n, e in per if keeps_precision(e))
        found = [*_reduce_finding(seen, reduced), *_resume_sample(spec, seen.params)]
        return dataclasses.replace(ledger, findings=tuple(found))

    def _count_micro_batches(self, opt: torch.optim.Optimizer, seen: _Seen) -> None:
        """At the second step: the micro-batches counted since the first (CW152)."""
        for h in seen.hooks:
            h.remove()
        seen.hooks = []
        ledger = self._pending.get(id(opt))
        accumulated = [(n, e) for n, e in ((n, s.error()) for n, s in seen.sums.items()) if e is not None]
        if ledger is not None and accumulated:
            self._pending[id(opt)] = dataclasses.replace(ledger, findings=(*ledger.findings, _cw152(seen, accumulated)))

    def _report_pending(self, key: int, seen: _Seen) -> None:
        """The ledger with CW150/CW153 of the steps seen: the stored samples against the f32 twin's."""
        ledger = self._pending.pop(key, None)
        if ledger is None:
            return
        if seen.ref:
            with torch.no_grad():
                after = {n: _rows(seen.params[n].detach()) for n in seen.ref}
                found = step_findings(seen.spec, seen.start, after, seen.ref, seen.keep)
            ledger = dataclasses.replace(ledger, findings=(*found, *ledger.findings))
        seen.twin, seen.ref, seen.grads, seen.start, seen.done = None, {}, {}, {}, True
        self.ledgers.append(ledger)
        if self.on_ledger is not None:
            self.on_ledger(ledger)

    def close(self) -> None:
        """The end of the run: optimizers that stepped fewer than ``STALL_STEPS`` times are
        reported as they are."""
        for key, seen in self._seen.items():
            for h in seen.hooks:
                h.remove()
            seen.hooks = []
            self._report_pending(key, seen)


# report a sum that lost 4x what storing its f32 value once in 16 bits loses, and at least 2^-7 of
# it (f16's single rounding is so small that 4x of it is still noise)
_WORSE, _FLOOR = 4.0, 2.0**-7


class _Sum:
    """A sample of one 16-bit parameter's gradient summed in f32 over the micro-batches of a step:
    a tensor hook sees each micro-batch's gradient before torch adds it into ``.grad`` (it returns
    None: the gradient is not changed)."""

    def __init__(self, p: torch.Tensor) -> None:
        self.p, self.count = p, 0
        self.total: torch.Tensor | None = None

    def add(self, grad: torch.Tensor) -> None:
        with torch.no_grad():
            if self.total is None:  # what .grad already holds (not zeroed since the step, or zeros)
                held = self.p.grad
                self.total = (
                    _rows(held).float().clone()
                    if held is not None
                    else torch.zeros_like(_rows(grad), dtype=torch.float32)
                )
            self.total += _rows(grad).float()
            self.count += 1

    def error(self) -> tuple[int, float, float] | None:
        """(micro-batches, relative error of the 16-bit sum, that of the f32 sum stored once in 16
        bits) when the sum lost ``_WORSE`` times more than storing it does and ``_FLOOR`` at least."""
        grad = self.p.grad
        if self.total is None or grad is None or self.count < 2:
            return None
        norm = float(self.total.norm())
        if norm == 0.0:
            return None
        err = float((_rows(grad.detach()).float() - self.total).norm()) / norm
        once = float((self.total.to(grad.dtype).float() - self.total).norm()) / norm
        return (self.count, err, once) if err >= max(_WORSE * once, _FLOOR) else None


def _sampled_state(state: Mapping[str, Any], p: torch.Tensor) -> dict[str, Any] | None:
    """The first rows of ``p``'s per-element state (scalars as they are), for the f32 twin of the
    step; None where a state is a low-bit subclass, whose rows cannot be taken as plain values."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            if type(v) not in (torch.Tensor, nn.Parameter):
                return None
            out[k] = _rows(v.detach()).clone() if v.shape == p.shape else v.detach().clone()
        else:
            out[k] = copy.deepcopy(v)
    return out


def _resume_sample(spec: OptimizerSpec, params: Mapping[str, torch.Tensor]) -> list[Finding]:
    """CW151 on a sample: a fresh optimizer of the same class and groups over samples of the
    parameters, one step, and its state_dict loaded into another, as a resume does."""
    twin = nn.Module()
    for i, p in enumerate(params.values()):
        if p.device.type == "meta" or not p.requires_grad:
            continue
        q = nn.Parameter(_rows(p.detach(), 256).clone())
        twin.register_parameter(f"p{i}", q)
    if not list(twin.parameters()):
        return []
    renamed = {f"p{i}": n for i, n in enumerate(params)}
    present = dict(twin.named_parameters())
    inverse = {n: k for k, n in renamed.items() if k in present}
    local = OptimizerSpec(
        spec.cls, tuple((tuple(inverse[n] for n in names if n in inverse), kw) for names, kw in spec.groups)
    )
    result = step_copy(twin, local, in_place=True)
    out = []
    for f in resume_findings(result):
        msg = f.message
        for k, n in sorted(renamed.items(), key=lambda kv: -len(kv[0])):
            msg = msg.replace(f"{k}.", f"{n}.")
        out.append(dataclasses.replace(f, message=msg))
    return out


_BYTES = {torch.float64: 8, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _reduce_finding(seen: _Seen, reduced: Mapping[int, tuple[torch.dtype, torch.dtype]]) -> list[Finding]:
    """CW232 at runtime: FSDP2 reduces gradients computed and kept wider than its reduce dtype."""
    narrow: dict[int | None, list[str]] = {}
    how: tuple[torch.dtype, torch.dtype, torch.dtype] | None = None
    for n, p in seen.params.items():
        compute, reduce = reduced.get(id(p), (p.dtype, p.dtype))
        if _BYTES.get(reduce, 4) < min(_BYTES.get(compute, 4), _BYTES.get(p.dtype, 4)):
            narrow.setdefault(seen.spec.group_of(n), []).append(n)
            how = how or (compute, reduce, p.dtype)
    if how is None:
        return []
    compute_s, reduce_s, kept_s = (short_of(d) for d in how)
    groups = "; ".join(
        f"param group {g}: {', '.join(ns[:6])}{f' (+{len(ns) - 6} more)' if len(ns) > 6 else ''}"
        for g, ns in narrow.items()
    )
    return [
        Finding(
            code="CW232",
            message=f"FSDP2 reduce-scatters gradients computed in {compute_s} and kept in {kept_s} in {reduce_s} "
            f"(MixedPrecisionPolicy reduce_dtype): {groups}. The reduction rounds every rank's gradient and "
            f"their sum to {reduce_s}, the precision the {compute_s} gradients were computed for.",
            fix="Reduce in the gradients' dtype: MixedPrecisionPolicy(reduce_dtype=torch.float32), or compute "
            "in the reduce dtype on purpose (param_dtype).",
            details=(("params", tuple(n for ns in narrow.values() for n in ns)),),
        )
    ]


def _cw152(seen: _Seen, accumulated: list[tuple[str, tuple[int, float, float]]]) -> Finding:
    n0, (k0, _, _) = accumulated[0]
    dt = short_of(seen.params[n0].dtype)
    by_group: dict[int | None, list[str]] = {}
    for n, (_, err, once) in accumulated:
        by_group.setdefault(seen.spec.group_of(n), []).append(f"{n} ({err:.1%} vs {once:.2%})")
    groups = "; ".join(
        f"param group {g}: {', '.join(ns[:6])}{f' (+{len(ns) - 6} more)' if len(ns) > 6 else ''}"
        for g, ns in by_group.items()
    )
    return Finding(
        code="CW152",
        message=f"the script summed {k0} micro-batches' gradients in {dt} .grad before its second optimizer "
        f"step, and the sum lost precision: {groups} (error of the {dt} sum against the same gradients summed "
        f"in f32, vs storing that f32 sum once in {dt}). Every backward rounds the running sum to {dt}.",
        fix="Accumulate in float32: param.grad_dtype = torch.float32 on these parameters (torch >= 2.9; "
        "with an optimizer that takes f32 gradients for 16-bit weights), f32 parameters under autocast, or "
        "fewer micro-batches per step.",
        details=(("params", tuple(n for n, _ in accumulated)), ("micro_batches", k0)),
    )


@contextmanager
def watch_steps(probe: StepProbe) -> Iterator[StepProbe]:
    """The probe on every optimizer step inside the block (torch's global step hooks)."""
    handles = [register_optimizer_step_pre_hook(probe.pre), register_optimizer_step_post_hook(probe.post)]
    try:
        yield probe
    finally:
        for h in handles:
            h.remove()
        probe.close()


def step_spec(model: nn.Module, optimizer: Any, kwargs: Mapping[str, Any] | None, mode: str) -> OptimizerSpec:
    """The audit's ``optimizer=`` / ``optimizer_kwargs=`` as a spec, or an AuditError saying what
    is valid."""
    if mode == "eval":
        raise AuditError("optimizer= steps after the train run's backward: use mode='train' or 'both', not 'eval'")
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        names = tuple(n for n, p in model.named_parameters() if p.requires_grad)
        return OptimizerSpec(optimizer, ((names, dict(kwargs or {})),))
    if kwargs is not None:
        raise AuditError(
            "optimizer_kwargs= goes with a torch.optim class (optimizer=torch.optim.AdamW, "
            "optimizer_kwargs={'lr': 1e-5}); an optimizer instance or a function brings its own settings"
        )
    if not (isinstance(optimizer, torch.optim.Optimizer | OptimizerSpec) or callable(optimizer)):
        raise AuditError(
            f"optimizer={type(optimizer).__name__}: give a torch.optim class (and optimizer_kwargs), an "
            "optimizer over the model's parameters, or a function model -> optimizer"
        )
    return spec_of(model, optimizer)
