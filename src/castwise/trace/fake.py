"""Fake copies: the user's model and inputs as fake tensors on the target device.

The copy is a ``deepcopy`` whose memo maps every parameter, buffer and plain tensor attribute to
a fake tensor of the same shape, stride and dtype on the target device: module objects are
copied (cheap), weights never are, so a 7B-parameter model (real or built on the meta device)
fits in memory. The user's model is only read.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from castwise.errors import AuditError


def new_mode() -> FakeTensorMode:
    # stray real tensors (module-level constants) are converted rather than refused; whether it may
    # touch the device is the host's answer while a run lasts (simcuda.host_device_init)
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_like(mode: FakeTensorMode, t: torch.Tensor, device: str) -> torch.Tensor:
    """A fake tensor with ``t``'s metadata on ``device`` (no data is read or copied). A tensor
    subclass that wraps others (DTensor, torchao's float8 weights, NF4) stays that subclass
    around fake inner tensors: its ops then run the subclass's own code, as the real ones do."""
    if is_traceable_wrapper_subclass(t):
        names, context = t.__tensor_flatten__()
        inner = {n: getattr(t, n) for n in names}  # tensors, and opaque parts (DTensor's mesh)
        inner = {n: fake_like(mode, v, device) if isinstance(v, torch.Tensor) else v for n, v in inner.items()}
        out: torch.Tensor = type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())
        return out
    with mode:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return out


def fake_model(model: nn.Module, mode: FakeTensorMode, device: str) -> nn.Module:
    memo: dict[int, Any] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(fake_like(mode, p.detach(), device), requires_grad=p.requires_grad)
        for b in module._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = fake_like(mode, b, device)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = fake_like(mode, value, device)
            elif type(value).__name__ == "ProcessGroup":  # shared, as the real run shares it (not picklable)
                memo[id(value)] = value
    try:
        copied = copy.deepcopy(model, memo)
    except Exception as exc:
        raise AuditError(
            f"cannot copy {type(model).__name__} to audit it on fake tensors ({type(exc).__name__}: {exc}); "
            "the audit never runs the user's own model object. Make the model deep-copyable, or audit "
            "the function that builds it (castwise audit file.py:build)"
        ) from exc
    copy_tensor_hooks(model, memo)
    return copied


def copy_tensor_hooks(model: nn.Module, memo: dict[int, Any]) -> None:
    """Gradient hooks (``param.register_hook``) live on the tensor, which a copy does not carry:
    register the user's hooks on the copies too, so backward runs them as the real run does."""
    seen: set[int] = set()
    for p in model.parameters():
        hooks = getattr(p, "_backward_hooks", None)
        twin = memo.get(id(p))
        if not hooks or twin is None or id(p) in seen:
            continue
        seen.add(id(p))
        for hook in hooks.values():
            twin.register_hook(hook)


def fake_input(t: torch.Tensor, mode: FakeTensorMode, device: str, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """One input tensor as a fake one on ``device`` (``memo``: shared tensors stay shared)."""
    if id(t) not in memo:
        fake = fake_like(mode, t.detach(), device)
        if t.requires_grad:
            fake.requires_grad_(True)
        memo[id(t)] = fake
    return memo[id(t)]


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (has no values)."""
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def real_model(model: nn.Module) -> nn.Module:
    """A full copy for a real-tensor audit (the user's model is never run)."""
    if on_meta(model):
        raise AuditError(
            f"{type(model).__name__} is on the meta device: it has no values to run on real tensors; "
            "audit it with fake=True (the default), or materialise it first"
        )
    memo: dict[int, Any] = {}
    try:
        copied = copy.deepcopy(model, memo)
    except Exception as exc:
        raise AuditError(
            f"cannot copy {type(model).__name__} for a real-tensor audit ({type(exc).__name__}: {exc}); "
            "audit it with fake=True (the default)"
        ) from exc
    copy_tensor_hooks(model, memo)
    return copied


@contextlib.contextmanager
def module_conversions() -> Iterator[None]:
    """While a fake audit runs, ``module.to(dtype)`` / ``.half()`` / ``.to(device)`` called inside
    forward (transformers' SwitchTransformers router re-casts its classifier on every call) changes
    fake parameters as it changes real ones. On real parameters ``nn.Module._apply`` sets
    ``param.data``: the parameter object, and the autograd node that accumulates its gradient, stay.
    On fake ones it always swaps the two tensor objects whole (``torch.utils.swap_tensors``), which
    refuses any tensor with a weak reference (every fake tensor an op made is held weakly by the
    fake mode's memo) or one saved for backward, so the model raised where the real run does not.
    Fake pairs get the real parameters' path (``.data =``, plus the fake tensor's own device and
    mode attributes); real tensors keep torch's own swap. Restored on exit."""
    original = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
            original(t1, t2)  # type: ignore[no-untyped-call]
            return
        with torch.no_grad():
            t1.data = t2
        # the fake tensor's own attributes (its device lives there); castwise's maps on t1 stay,
        # as a real parameter's attributes do under ``.data =``
        t1.__dict__.update({k: v for k, v in t2.__dict__.items() if not k.startswith("_castwise_")})

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def scalar_formatting() -> Iterator[None]:
    """While a fake audit runs, a 0-dim fake integer tensor formatted into a string formats its
    value, as a real one does (``Tensor.__format__`` calls ``.item()`` only for plain tensors, so a
    fake one printed its repr: SwitchTransformers' experts look up ``self[f"expert_{idx[0]}"]`` and raised
    KeyError). The value is the tracer's, as for any ``.item()``. Restored on exit."""
    original = torch.Tensor.__format__

    def __format__(self: torch.Tensor, format_spec: str) -> str:
        # integers only: an index picks code (a module by name); a float is formatted for logging
        if isinstance(self, FakeTensor) and self.dim() == 0 and not self.is_floating_point():
            try:
                return format(self.item(), format_spec)
            except Exception:  # no value to be had (outside the tracer): torch's own formatting
                pass
        text: str = original(self, format_spec)  # type: ignore[no-untyped-call]
        return text

    torch.Tensor.__format__ = __format__  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.__format__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def untraced_look() -> Iterator[None]:
    """While a fake audit runs, transformers does not take the fake tensors for a trace.

    ``transformers.utils.import_utils.is_tracing`` counts a FakeTensor as tracing (torch.export
    runs on them), and model code then takes its compile path: the causal mask is built as a
    tensor instead of SDPA's ``is_causal`` (masking_utils' ``_ignore_causal_mask_sdpa``), and
    value checks are skipped. The real run takes the eager path, so the audit would check
    another one: BART under reentrant checkpointing recomputes its decoder with the grown cache,
    which ``is_causal`` takes and the mask built for the first pass refuses. The fake run answers
    value questions itself (trace/values.py), so it can take the eager path. Only a transformers
    already imported is changed (castwise never imports it); restored on exit."""
    module = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_fake_tensor", None)
    if module is None or original is None:
        yield
        return

    def is_fake_tensor(x: Any) -> bool:
        return False

    module.is_fake_tensor = is_fake_tensor  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.is_fake_tensor = original  # type: ignore[attr-defined]
