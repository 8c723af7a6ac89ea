"""User hooks, observed: gradient hooks on parameters and forward hooks on modules.

Hooks change dtypes where no module's forward does: a gradient hook returning ``grad.to(bf16)``
makes backward raise "hook ... has changed the type of value"; a forward hook returning
``out.float()`` sends float32 into the next layer. The tracer wraps the hooks of its own copy of
the model (never the user's): ops a forward hook runs are attributed to the hooked module, and
every hook that returns another dtype than it got is recorded with its name and source line.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from castwise.trace.events import Frame, HookChange
from castwise.trace.source import short_path

if TYPE_CHECKING:
    from castwise.trace.tracer import Tracer


def hook_name(hook: Any) -> str:
    name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or type(hook).__name__
    return str(name)


def hook_source(hook: Any) -> str | None:
    """Where the hook is defined ("train.py:12"), when Python can tell."""
    target = getattr(hook, "__func__", hook)
    code = getattr(target, "__code__", None)
    if code is None:
        try:
            lines = inspect.getsourcelines(target)
            path = inspect.getsourcefile(target)
        except (OSError, TypeError):
            return None
        return f"{short_path(path or '?')}:{lines[1]}"
    return f"{short_path(code.co_filename)}:{code.co_firstlineno}"


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)) and obj and isinstance(obj[0], torch.Tensor):
        return obj[0]
    return None


def _grad_hook(tracer: Tracer, module: str, tensor: str, hook: Any) -> Any:
    def observed(grad: torch.Tensor) -> Any:
        out = hook(grad)
        if isinstance(out, torch.Tensor) and out.dtype != grad.dtype:
            tracer.trace.hook_changes.append(
                HookChange("grad", module, tensor, hook_name(hook), grad.dtype, out.dtype, hook_source(hook))
            )
        return out

    return observed


def _forward_hook(tracer: Tracer, name: str, hook: Any) -> Any:
    def observed(module: nn.Module, *args: Any) -> Any:
        before = _first_tensor(args[-1])  # the output the hook is given (last positional argument)
        enabled = torch.is_autocast_enabled(tracer.device_type)
        tracer.stack.append(Frame(name, module, torch.get_autocast_dtype(tracer.device_type) if enabled else None, []))
        tracer.hook_stack.append(hook_name(hook))
        try:
            out = hook(module, *args)
        finally:
            tracer.hook_stack.pop()
            if tracer.stack and tracer.stack[-1].module is module:
                tracer.stack.pop()
        after = _first_tensor(out)
        if before is not None and after is not None and after.dtype != before.dtype:
            tracer.trace.hook_changes.append(
                HookChange("forward", name, None, hook_name(hook), before.dtype, after.dtype, hook_source(hook))
            )
        return out

    return observed


def observe_hooks(tracer: Tracer, model: nn.Module) -> None:
    """Wrap the gradient hooks of ``model``'s parameters and its modules' forward hooks (the
    audit's copy: the user's model is never touched)."""
    seen: set[int] = set()
    for mname, module in model.named_modules():
        for pname, p in module._parameters.items():
            hooks = getattr(p, "_backward_hooks", None) if p is not None else None
            if not hooks or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mname}.{pname}" if mname else pname
            for key, hook in list(hooks.items()):
                hooks[key] = _grad_hook(tracer, mname, f"param {full}", hook)
        for key, hook in list(module._forward_hooks.items()):
            module._forward_hooks[key] = _forward_hook(tracer, mname, hook)
