"""Running a model on real tensors under the tracer, leaving the user's model as it was."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise._dtypes import is_low
from castwise.errors import AuditError, CastwiseError
from castwise.numerics._failed import RunRaised, add_diagnosis
from castwise.report import Report
from castwise.run import Inputs, RunRequest, check, model_device
from castwise.run.request import RUN_MODES
from castwise.trace.attribution import tensors_of
from castwise.trace.observers import Observer
from castwise.trace.tracer import Tracer, run


def check_args(
    what: str, model: Any, inputs: Any, policy: Any, device: Any, mode: Any, *, meta_ok: bool = False
) -> RunRequest:
    """A numerics entry's request: one mode, real tensors, the user's model as it is (under
    ``castwise.apply`` too); ``meta_ok``: a layerwise run materialises meta weights itself."""
    return check(
        what,
        model,
        inputs,
        policy=policy,
        device=device,
        mode=mode,
        fake=False,
        modes=RUN_MODES,
        meta_ok=meta_ok,
        applied_ok=True,
    )


class Capture(nn.Module):
    """Runs ``fn(model, *args, **kwargs)`` and keeps the output (to check it once the run ended).
    The tracer names modules from ``model``: this wrapper itself is never named."""

    def __init__(self, model: nn.Module, fn: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.inner = model
        self.__dict__["fn"] = fn
        self.__dict__["out"] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.__dict__["fn"]
        out = self.inner(*args, **kwargs) if fn is None else fn(self.inner, *args, **kwargs)
        self.__dict__["out"] = out
        return out


@contextlib.contextmanager
def kept_as_is(model: nn.Module) -> Iterator[None]:
    """Run on the user's model itself and put back what a forward/backward changes: ``.grad``,
    buffers (running statistics), train/eval flags. Parameters are not written by a run."""
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for p, g in grads:
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def recast(model: nn.Module, which: Callable[[torch.dtype], bool], to: torch.dtype) -> Iterator[None]:
    """Floating parameters and buffers whose dtype ``which`` picks held in ``to`` for the duration
    (the originals are put back as they were: no round trip through a cast)."""
    saved: list[tuple[Any, torch.Tensor]] = []
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point() and which(t.dtype):
            saved.append((t, t.data))
            t.data = t.data.to(to)
    try:
        yield
    finally:
        for t, data in saved:
            t.data = data


def widened(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Low-precision parameters and buffers as float32 (the rerun's question: is it finite in float32?)."""
    return recast(model, is_low, torch.float32)


@dataclass(frozen=True)
class RunResult:
    trace: Any
    out: Any
    final_nonfinite: bool
    error: BaseException | None


def traced(
    model: nn.Module, wrapper: Capture, inputs: Inputs, mode: str, device: str, observers: Sequence[Observer]
) -> RunResult:
    """One run of ``wrapper`` (forward, and backward in train mode) under a real-tensor tracer."""
    tracer = Tracer(model, device, fake=False, record_ops=False, observers=observers)
    trace = run(tracer, wrapper, inputs.args, inputs.kwargs, mode, engine_backward=True)
    out = wrapper.__dict__["out"]
    wrapper.__dict__["out"] = None
    bad = any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors_of(out))
    if not bad and mode == "train":
        bad = any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    return RunResult(trace, out, bad, trace.error)


def on_device(model: nn.Module, policy: Any, device: str) -> tuple[nn.Module, Any]:
    """The model to run: the user's own (nothing to change), or a copy moved to ``device`` and
    under ``policy`` (with the Applied to remove)."""
    if policy is None and device == model_device(model):
        return model, None
    try:
        dup = copy.deepcopy(model).to(device)
    except Exception as exc:
        raise AuditError(
            f"cannot copy {type(model).__name__} to run it under a policy or on {device} "
            f"({type(exc).__name__}: {exc}); apply the policy yourself and pass policy=None"
        ) from exc
    if policy is None:
        return dup, None
    from castwise.applied import apply

    try:
        return dup, apply(dup, policy)
    except CastwiseError as exc:
        raise AuditError(f"policy {policy}: {exc}") from exc


def reported(
    request: RunRequest,
    what: str,
    body: Callable[[nn.Module], tuple[Report, BaseException | None]],
    *,
    copy_ok: bool = True,
    audit: bool = True,
) -> Report:
    """``body``'s report of a run on the model to run (``on_device``; ``copy_ok`` False: the model
    itself, one on the meta device), kept as is, with the policy removed again and global state
    left as it was (castwise.auditor). Where the model raised, the audit's diagnosis goes first."""
    from castwise.auditor import preserved_state

    model, policy = request.model, request.policy
    with preserved_state():
        target, applied = on_device(model, policy, request.torch_device) if copy_ok else (model, None)
        try:
            with kept_as_is(target):
                report, error = body(target)
        finally:
            if applied is not None:
                applied.remove()
    if error is not None:
        raised = RunRaised(f"{what}'s run (policy {policy if policy is not None else 'none'})", policy, error)
        add_diagnosis(report, request, raised, audit=audit)
    return report


def nonfinite_state(model: nn.Module, inputs: Inputs) -> list[str]:
    """Parameters, buffers and inputs that already hold NaN/Inf (no op made them)."""
    named = [
        *(("parameter", n, p) for n, p in model.named_parameters()),
        *(("buffer", n, b) for n, b in model.named_buffers()),
        *(("input", n, t) for n, t in inputs.named(model)),
    ]
    return [f"{kind} {n}" for kind, n, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]
