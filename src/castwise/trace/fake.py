"""Fake copies: the user's model and inputs as fake tensors on the target device.

The copy is a ``deepcopy`` whose memo maps every parameter, buffer and plain tensor attribute to
a fake tensor of the same shape, stride and dtype on the target device: module objects are
copied (cheap), weights never are, so a 7B-parameter model (real or built on the meta device)
fits in memory. The user's model is only read.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from castwise.devices import Device
from castwise.errors import AuditError
from castwise.trace.cuda_guard import stand_in_guard


def new_mode() -> FakeTensorMode:
    # stray real tensors (module-level constants) are converted rather than refused
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_like(mode: FakeTensorMode, t: torch.Tensor, device: str) -> torch.Tensor:
    """A fake tensor with ``t``'s metadata on ``device`` (no data is read or copied)."""
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


def fake_inputs(obj: Any, mode: FakeTensorMode, device: str, memo: dict[int, torch.Tensor]) -> Any:
    """The inputs with every tensor replaced by a fake one on ``device`` (shared tensors stay shared)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            fake = fake_like(mode, obj.detach(), device)
            if obj.requires_grad:
                fake.requires_grad_(True)
            memo[id(obj)] = fake
        return memo[id(obj)]
    if isinstance(obj, tuple):
        items = [fake_inputs(x, mode, device, memo) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [fake_inputs(x, mode, device, memo) for x in obj]
    if isinstance(obj, dict):
        return {k: fake_inputs(v, mode, device, memo) for k, v in obj.items()}
    return obj


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


def real_inputs(obj: Any) -> Any:
    """Inputs for a real audit: tensors cloned, so an in-place model cannot change the caller's."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().requires_grad_(obj.requires_grad)
    if isinstance(obj, tuple):
        items = [real_inputs(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [real_inputs(x) for x in obj]
    if isinstance(obj, dict):
        return {k: real_inputs(v) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def simulated_cuda(device: Device) -> Iterator[None]:
    """While a fake audit simulates ``device`` (a CUDA one): fake CUDA tensors carry gradients on
    any torch build, CPU-only ones included (trace/cuda_guard.py), and model code that asks the
    CUDA runtime for the device's compute capability gets the simulated device's, instead of the
    error a machine without a GPU raises (which would stop the run: transformers' MoE experts ask
    it before every grouped GEMM). Restored on exit."""
    with stand_in_guard():
        if device.capability is None:
            yield
            return
        capability = device.capability
        original = torch.cuda.get_device_capability

        def get_device_capability(device: torch.device | str | int | None = None) -> tuple[int, int]:
            return capability

        torch.cuda.get_device_capability = get_device_capability
        try:
            yield
        finally:
            torch.cuda.get_device_capability = original
