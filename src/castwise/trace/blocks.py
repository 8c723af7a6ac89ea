"""Which modules are repeated blocks, and what a block's traced record depends on in the block
itself (``trace/reuse.py`` adds what depends on each call: its arguments, autocast, grad mode).

A block is a composite child of a ``ModuleList``/``Sequential`` beside another of its class,
outermost only. Its static key: per submodule, the class and forward (an instance override by
code and closure: a policy's island wrapper is one closure per module, alike in all but it),
training mode, parameter, buffer and tensor-attribute metadata, and plain attributes (ints
other than an index: a layer's own number does not steer its dtypes). A hook anywhere makes the
key None: the block traces for itself.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from castwise.trace.events import shape_of

PLAIN = (bool, str, float, type(None), torch.dtype, torch.device)  # compared by value
_INDEX_WORDS = ("idx", "index", "layer_id", "layer_num", "block_id")


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def renamed(name: str, old: str, new: str) -> str:
    return new + name[len(old) :] if within(name, old) else name


# -- keys -----------------------------------------------------------------------------------------


def _forward_key(module: nn.Module) -> Any:
    """The forward a call runs: the class's, or an instance override by code and closure (a
    policy's island wrapper is one closure per module, alike in all but the module)."""
    own = module.__dict__.get("forward")
    return (type(module).forward, None if own is None else _callable_key(own, 0))


def _callable_key(fn: Any, depth: int) -> Any:
    if isinstance(fn, types.MethodType):
        return ("method", _callable_key(fn.__func__, depth))
    code = getattr(fn, "__code__", None)
    if code is None or depth > 3:
        return ("object", id(fn))
    cells = tuple(_value_key(c.cell_contents, depth + 1) for c in (fn.__closure__ or ()))
    return ("function", code, cells)


def _value_key(value: Any, depth: int) -> Any:
    if isinstance(value, PLAIN) or type(value) is int:
        return value
    if isinstance(value, nn.Module):
        return ("module", type(value))
    if callable(value):
        return _callable_key(value, depth)
    return ("object", id(value))


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    stride = () if t.is_nested else t.stride()
    return (type(t), t.dtype, shape_of(t), stride, t.device, t.requires_grad)


def _has_hooks(module: nn.Module) -> bool:
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return True
    if getattr(module, "_backward_pre_hooks", None):
        return True
    return any(getattr(p, "_backward_hooks", None) for p in module._parameters.values() if p is not None)


def _attrs_key(module: nn.Module) -> tuple[Any, ...] | None:
    out: list[Any] = []
    for aname, value in vars(module).items():
        if aname.startswith("_") or aname == "forward":
            continue
        if isinstance(value, torch.Tensor):
            out.append((aname, tensor_key(value)))
        elif isinstance(value, PLAIN) or (type(value) is int and not any(w in aname.lower() for w in _INDEX_WORDS)):
            out.append((aname, value))
    return tuple(out)


def static_key(block: nn.Module) -> tuple[Any, ...] | None:
    """What a block's record depends on in the block itself; None: it must trace for itself."""
    parts: list[Any] = []
    for rel, m in block.named_modules():
        if _has_hooks(m):
            return None
        tensors = tuple(
            (kind, n, None if t is None else tensor_key(t))
            for kind, store in (("p", m._parameters), ("b", m._buffers))
            for n, t in store.items()
        )
        parts.append((rel, type(m), _forward_key(m), m.training, tensors, _attrs_key(m)))
    return tuple(parts)


def global_hooks() -> bool:
    """Whether a global module hook other than the tracer's own two is registered."""
    mod: Any = torch.nn.modules.module
    own = len(mod._global_forward_hooks) + len(mod._global_forward_pre_hooks)
    return own > 2 or bool(mod._global_backward_hooks) or bool(mod._global_backward_pre_hooks)


def _is_block(module: nn.Module, siblings: list[nn.Module]) -> bool:
    """A composite module beside another of its class (a leaf layer is not worth a record)."""
    if not module._modules:
        return False
    return sum(type(s) is type(module) for s in siblings) > 1


def find_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost repeated blocks: children of a ModuleList/Sequential, by name."""
    found: dict[str, nn.Module] = {}
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        if any(within(name, b) for b in found):
            continue
        children = list(container._modules.values())
        for cname, child in container._modules.items():
            if child is not None and _is_block(child, [c for c in children if c is not None]):
                found[f"{name}.{cname}" if name else cname] = child
    return found
