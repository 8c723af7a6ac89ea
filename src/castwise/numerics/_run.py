"""Running a model on real tensors under the tracer, leaving the user's model as it was."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise import devices
from castwise.errors import AuditError, CastwiseError, PolicyError
from castwise.trace.fake import on_meta
from castwise.trace.observers import Observer, flat_outputs
from castwise.trace.tracer import Tracer, run

MODES = ("eval", "train")


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return inputs, {}
    if isinstance(inputs, list):
        return tuple(inputs), {}
    return (inputs,), {}


def model_device(model: nn.Module) -> str:
    for t in (*model.parameters(), *model.buffers()):
        return t.device.type
    return "cpu"


def real_device(name: str) -> str:
    """The torch device a real run on ``name`` (a registered device) uses; a CPU class other
    than this machine's is refused (its kernels are not the ones that would run)."""
    try:
        target = devices.get(name)
    except CastwiseError:
        raise AuditError(
            f"device={name!r} is not valid; valid: {', '.join(devices.names())} (or None: where the model is)"
        ) from None
    here = devices.other_cpu(target)
    if here is not None:
        raise AuditError(
            f"device={name!r}: a real run uses this machine's CPU kernels ({here.describe()}); pass device='cpu'"
        )
    return target.fake_device


def check_args(what: str, model: Any, policy: Any, device: Any, mode: Any, *, meta_ok: bool = False) -> tuple[Any, str]:
    """The parsed policy (or None) and the device to run on; a CastwiseError on bad arguments
    (``meta_ok``: a layerwise run materialises the model's meta-device weights itself)."""
    if not isinstance(model, nn.Module):
        raise AuditError(f"{what} needs a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise AuditError(f"mode={mode!r} is not valid; valid: {', '.join(MODES)}")
    dev = device if device is not None else model_device(model)
    if meta_ok and dev == "meta":
        dev = "cpu"  # where its weights are materialised
    dev = real_device(str(dev))
    if dev == "cuda" and not torch.cuda.is_available():
        raise AuditError(f"{what} runs on real tensors and this machine has no CUDA device; pass device='cpu'")
    if not meta_ok and on_meta(model):
        raise AuditError(
            f"{type(model).__name__} is on the meta device: {what} needs values; materialise it "
            "first, pass a shrunk config, or run forecast(..., layerwise=True, weights=FILE)"
        )
    if policy is None:
        return None, dev
    from castwise.policy import Policy

    if not isinstance(policy, (str, Policy)):
        raise AuditError(f"policy must be a castwise.Policy, a policy string or None, not {type(policy).__name__}")
    try:
        return Policy.parse(policy), dev
    except PolicyError as exc:
        raise AuditError(f"policy: {exc}") from exc


def real_inputs(obj: Any, device: str) -> Any:
    """The inputs cloned (an in-place model must not change the caller's) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device, copy=True).requires_grad_(obj.requires_grad)
    if isinstance(obj, tuple):
        items = [real_inputs(x, device) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [real_inputs(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: real_inputs(v, device) for k, v in obj.items()}
    return obj


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
def widened(model: nn.Module) -> Iterator[None]:
    """Low-precision parameters and buffers as float32 for the duration (the originals are put
    back as they were: no round trip through a cast)."""
    saved: list[tuple[Any, torch.Tensor]] = []
    for t in (*model.parameters(), *model.buffers()):
        if t.dtype in (torch.float16, torch.bfloat16):
            saved.append((t, t.data))
            t.data = t.data.float()  # the rerun's question: is it finite in float32?
    try:
        yield
    finally:
        for t, data in saved:
            t.data = data


def widen_inputs(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.dtype in (torch.float16, torch.bfloat16):
        return obj.detach().float().requires_grad_(obj.requires_grad)  # the rerun is in float32
    if isinstance(obj, tuple):
        items = [widen_inputs(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [widen_inputs(x) for x in obj]
    if isinstance(obj, dict):
        return {k: widen_inputs(v) for k, v in obj.items()}
    return obj


@dataclass(frozen=True)
class RunResult:
    trace: Any
    out: Any
    final_nonfinite: bool
    error: BaseException | None


def traced(
    model: nn.Module, wrapper: Capture, inputs: Any, mode: str, device: str, observers: Sequence[Observer]
) -> RunResult:
    """One run of ``wrapper`` (forward, and backward in train mode) under a real-tensor tracer."""
    args, kwargs = split_inputs(inputs)
    tracer = Tracer(model, device, fake=False, record_ops=False, observers=observers)
    trace = run(tracer, wrapper, args, kwargs, mode, engine_backward=True)
    out = wrapper.__dict__["out"]
    wrapper.__dict__["out"] = None
    bad = any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in flat_outputs(out))
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


def nonfinite_state(model: nn.Module, inputs: Any) -> list[str]:
    """Parameters, buffers and inputs that already hold NaN/Inf (no op made them)."""
    bad = [
        f"parameter {n}"
        for n, p in model.named_parameters()
        if p.is_floating_point() and not bool(torch.isfinite(p).all())
    ]
    bad += [
        f"buffer {n}" for n, b in model.named_buffers() if b.is_floating_point() and not bool(torch.isfinite(b).all())
    ]

    def walk(name: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
                bad.append(f"input {name}")
        elif isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                walk(f"{name}[{i}]", x)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{name}[{k!r}]" if name else str(k), v)

    walk("", inputs)
    return bad
