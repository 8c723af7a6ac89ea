"""What a run's inputs mean, decided once for every entry, and walked with ``torch.utils._pytree``.

The rule (``castwise.audit``, every numerics entry, the distributed audit, ``castwise run``): a
dict is keyword arguments, ``model(**inputs)``; a plain tuple or list is positional arguments,
``model(*inputs)``; any other object (a tensor, a namedtuple, a dataclass, a ``ModelOutput``, a
batch object) is one positional argument, ``model(inputs)``, as the model's own ``model(batch)``.
The tree below the arguments is torch's pytree: tuples, lists, dicts, namedtuples and the types
registered with it (transformers' ``ModelOutput``, diffusers' ``BaseOutput``) are walked and
rebuilt as their own type; anything else is a leaf.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from castwise._dtypes import is_low


def split(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) by the rule above (a namedtuple or a dict subclass such as ModelOutput is
    one argument: the model is called on the object it was given)."""
    if type(inputs) in (dict, OrderedDict):
        return (), dict(inputs)
    if type(inputs) in (tuple, list):
        return tuple(inputs), {}
    return (inputs,), {}


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` rebuilt with every tensor replaced by ``fn(tensor)`` (each node as its own type)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, obj)


def _leaf_names(name: str, spec: pytree.TreeSpec) -> list[str]:
    """One name per leaf of ``spec`` under ``name``: ``x[0]`` by position, ``batch['ids']`` by key
    (dicts and the registered keyed types, whose context lists their keys)."""
    if spec.is_leaf():
        return [name]
    children = spec.children()
    keys = spec.context if isinstance(spec.context, list) and len(spec.context) == len(children) else None
    out: list[str] = []
    for i, child in enumerate(children):
        out += _leaf_names(f"{name}[{keys[i]!r}]" if keys is not None else f"{name}[{i}]", child)
    return out


def _arg_names(model: nn.Module, n: int) -> list[str]:
    """The forward signature's names of the first ``n`` positional arguments (``arg{i}`` past them)."""
    try:
        params = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


@dataclass(frozen=True, eq=False)
class Inputs:
    """A run's inputs, flattened once: ``args``/``kwargs`` by the rule, their ``leaves`` and the
    ``spec`` that rebuilds them; every conversion is a map over the leaves."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec

    @classmethod
    def of(cls, inputs: Any) -> Inputs:
        if isinstance(inputs, Inputs):
            return inputs
        return cls.called(*split(inputs))

    @classmethod
    def called(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Inputs:
        """The inputs of the call ``model(*args, **kwargs)``, as it was made."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        return cls(tuple(args), dict(kwargs), tuple(leaves), spec)

    def map(self, fn: Callable[[torch.Tensor], Any]) -> Inputs:
        """The inputs with every tensor leaf replaced by ``fn(leaf)``, rebuilt by the same tree."""
        leaves = tuple(fn(x) if isinstance(x, torch.Tensor) else x for x in self.leaves)
        args, kwargs = pytree.tree_unflatten(list(leaves), self.spec)
        return Inputs(tuple(args), dict(kwargs), leaves, self.spec)

    def tensors(self) -> list[torch.Tensor]:
        return [x for x in self.leaves if isinstance(x, torch.Tensor)]

    def named(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) per tensor leaf: ``x``, ``x[0]``, ``batch['ids']``, ``arg2`` (names from
        ``model``'s forward signature)."""
        args_spec, kwargs_spec = self.spec.children()
        names = [
            n
            for top, child in zip(_arg_names(model, len(self.args)), args_spec.children(), strict=True)
            for n in _leaf_names(top, child)
        ]
        keys = kwargs_spec.context
        names += [n for key, child in zip(keys, kwargs_spec.children(), strict=True) for n in _leaf_names(key, child)]
        return [(n, x) for n, x in zip(names, self.leaves, strict=True) if isinstance(x, torch.Tensor)]

    def call(self, model: Callable[..., Any]) -> Any:
        return model(*self.args, **self.kwargs)

    def real(self, device: str | None = None) -> Inputs:
        """Tensors cloned (on ``device``): an in-place model must not change the caller's."""

        def clone(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device or t.device, copy=True).requires_grad_(t.requires_grad)

        return self.map(clone)

    def widen(self) -> Inputs:
        """Half-precision tensors as float32 (a rerun's question: is it finite in float32?)."""

        def wide(t: torch.Tensor) -> torch.Tensor:
            if not is_low(t.dtype):
                return t
            return t.detach().float().requires_grad_(t.requires_grad)

        return self.map(wide)

    def fake(self, mode: Any, device: str, memo: dict[int, torch.Tensor]) -> Inputs:
        """Every tensor as a fake one on ``device`` made by ``mode`` (``memo``: each real tensor's
        fake by id, so tensors shared in the inputs stay shared)."""
        from castwise.trace.fake import fake_input

        return self.map(lambda t: fake_input(t, mode, device, memo))
