"""User hooks, observed: gradient hooks on parameters and forward hooks on modules.

Hooks change dtypes where no module's forward does: a gradient hook returning ``grad.to(bf16)``
makes backward raise "hook ... has changed the type of value"; a forward hook returning
``out.float()`` sends float32 into the next layer. The tracer wraps the hooks of its own copy of
the model (never the user's): ops a forward hook runs are attributed to the hooked module, and
every hook that returns another dtype than it got is recorded with its name and source line.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from castwise._dtypes import fmt_tensor, name_of
from castwise.trace.events import Frame, HookChange, shape_of
from castwise.trace.source import line_text, short_path

if TYPE_CHECKING:
    from castwise.trace.attribution import Attribution
    from castwise.trace.record import Recorder


# the hooks (by qualified name) whose results the run casts back to the dtype they were given: the
# code fix "return new.to(grad.dtype)" simulated, so a re-audit verifies it (auditor/suggest.py)
_CAST_BACK: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("castwise_cast_back", default=frozenset())


@contextmanager
def casting_back(names: frozenset[str]) -> Iterator[None]:
    """Runs traced inside this block cast the results of the hooks named ``names`` back to the
    dtype each was given (the code fix of CW115, simulated)."""
    token = _CAST_BACK.set(names)
    try:
        yield
    finally:
        _CAST_BACK.reset(token)


def _cast_like(out: Any, given: Any) -> Any:
    """``out`` with each tensor cast to the dtype of the tensor at its place in ``given``."""
    if isinstance(out, torch.Tensor) and isinstance(given, torch.Tensor):
        return out.to(given.dtype) if out.dtype != given.dtype else out
    if isinstance(out, (tuple, list)) and isinstance(given, (tuple, list)) and len(out) == len(given):
        return type(out)(_cast_like(o, g) for o, g in zip(out, given, strict=True))
    return out


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


def return_fix(hook: Any, given: str) -> tuple[str, int, str, str | None] | None:
    """The hook's last ``return <expr>`` line with ``.to(<given>.dtype)`` added (``given``: which
    argument's dtype, "grad" or "output"), as (file, line, new line, old line); None for a hook
    whose source Python cannot show or that has no such line (a lambda)."""
    target = getattr(hook, "__func__", hook)
    try:
        lines, first = inspect.getsourcelines(target)
        path = inspect.getsourcefile(target)
        params = list(inspect.signature(target).parameters)
    except (OSError, TypeError, ValueError):
        return None
    want = params[0] if given == "grad" and params else params[2] if given == "output" and len(params) > 2 else None
    returns = [i for i, line in enumerate(lines) if line.strip().startswith("return ")]
    if path is None or want is None or not returns:
        return None
    number = first + returns[-1]
    old = line_text(path, number) or lines[returns[-1]].rstrip("\n")
    indent = old[: len(old) - len(old.lstrip())]
    expr = old.strip().removeprefix("return ").split("  #", 1)[0].strip()
    simple = expr.replace(".", "").replace("_", "").isalnum() or expr.endswith(")")
    new = f"{indent}return {expr if simple else f'({expr})'}.to({want}.dtype)"
    return short_path(path), number, new, old


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)) and obj and isinstance(obj[0], torch.Tensor):
        return obj[0]
    return None


def _grad_hook(recorder: Recorder, module: str, tensor: str, hook: Any) -> Any:
    name = hook_name(hook)

    @functools.wraps(hook)  # autograd's "hook '<name>' has changed the type" names the user's hook
    def observed(grad: torch.Tensor) -> Any:
        out = hook(grad)
        if name in _CAST_BACK.get():
            out = _cast_like(out, grad)
        if isinstance(out, torch.Tensor) and out.dtype != grad.dtype:
            fix = return_fix(hook, "grad")
            recorder.hook_change(
                HookChange("grad", module, tensor, name, grad.dtype, out.dtype, hook_source(hook), fix)
            )
        return out

    return observed


def _forward_hook(at: Attribution, recorder: Recorder, name: str, hook: Any) -> Any:
    @functools.wraps(hook)
    def observed(module: nn.Module, *args: Any) -> Any:
        before = _first_tensor(args[-1])  # the output the hook is given (last positional argument)
        enabled = torch.is_autocast_enabled(at.device_type)
        at.stack.append(Frame(name, module, torch.get_autocast_dtype(at.device_type) if enabled else None, []))
        at.hook_stack.append(hook_name(hook))
        try:
            out = hook(module, *args)
            if out is not None and hook_name(hook) in _CAST_BACK.get():
                out = _cast_like(out, args[-1])
        finally:
            at.hook_stack.pop()
            if at.stack and at.stack[-1].module is module:
                at.stack.pop()
        after = _first_tensor(out)
        if before is not None and after is not None and after.dtype != before.dtype:
            fix = return_fix(hook, "output")
            recorder.hook_change(
                HookChange("forward", name, None, hook_name(hook), before.dtype, after.dtype, hook_source(hook), fix)
            )
        return out

    return observed


def observe_hooks(at: Attribution, recorder: Recorder, model: nn.Module) -> None:
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
                hooks[key] = _grad_hook(recorder, mname, f"param {full}", hook)
        for key, hook in list(module._forward_hooks.items()):
            module._forward_hooks[key] = _forward_hook(at, recorder, mname, hook)


@contextmanager
def tensor_hooks(at: Attribution, recorder: Recorder) -> Iterator[None]:
    """Gradient hooks registered on activations while the model runs (``out.register_hook(h)`` in
    a forward or a forward hook) are observed like parameters' hooks, and named after the module
    whose code registered them (the hooked module for a forward hook, else the module running),
    or the module that made the tensor when no module runs."""
    original: Any = torch.Tensor.register_hook  # torch leaves it untyped

    def register(t: torch.Tensor, hook: Any) -> Any:
        if t not in at.creator:  # not one of this run's tensors (a user's own model elsewhere)
            return original(t, hook)
        module = at.stack[-1].name if at.stack else str(at.creator.get(t, ""))
        label = f"tensor {fmt_tensor(name_of(t.dtype), shape_of(t))}"
        return original(t, _grad_hook(recorder, module, label, hook))

    torch.Tensor.register_hook = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]


@contextmanager
def refused_operands(at: Attribution) -> Iterator[None]:
    """``scaled_dot_product_attention`` checks q/k/v dtypes before it dispatches, so the tracer
    never sees those operands: when it raises, keep them (and a floating mask) in
    ``at.refused`` with the module, so the finding blames the operand off the run's dtype."""
    functional: Any = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception:
            named = [kwargs.get(k) for k in ("query", "key", "value", "attn_mask")]
            given = [*args[:4], *named[len(args[:4]) :]]
            operands = [t for t in given if isinstance(t, torch.Tensor) and t.is_floating_point()]
            at.refused = (at.module(), operands)
            raise

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original
