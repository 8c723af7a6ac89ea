"""Backward without the autograd engine, for simulated devices.

The engine needs a CUDA context for CUDA tensors, which a CPU-only machine cannot create, even
for fake ones. Calling the autograd nodes directly runs the same backward formulas and tells the
attribution which node runs (its ops belong to the module that made it).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint

if TYPE_CHECKING:
    from castwise.trace.attribution import Attribution


def _edge(t: Any) -> tuple[Any, int]:
    if isinstance(t, torch.Tensor):
        edge = torch.autograd.graph.get_gradient_edge(t)
        return edge.node, edge.output_nr
    return t.node, t.output_nr  # a GradientEdge


def python_backward(
    at: Attribution, roots: Any, grads: Any, inputs: Any = (), accumulate: bool = True
) -> tuple[torch.Tensor | None, ...]:
    """Backward without the autograd engine, node by node (what ``torch.autograd.backward`` and
    ``torch.autograd.grad`` do, minus hooks and streams).

    The engine needs a CUDA context for CUDA tensors, which a CPU-only machine cannot create,
    even for fake ones; calling the nodes directly runs the same backward formulas, and tells
    which node runs, for attribution. Tensor hooks run as the engine runs them (before the node
    that takes the gradient, and refused when they change its dtype); node hooks do not.
    """
    buffers: dict[Any, list[torch.Tensor | None]] = {}

    def add(node: Any, nr: int, g: torch.Tensor) -> None:
        buf = buffers.setdefault(node, [])
        buf.extend([None] * (nr + 1 - len(buf)))
        current = buf[nr]
        buf[nr] = g if current is None else current + g

    starts = []
    for root, g in zip(roots, grads, strict=False):
        node, nr = _edge(root)
        if node is None:
            continue
        if g is None:
            g = torch.ones_like(root)
        add(node, nr, g)
        starts.append(node)
    targets = [_edge(t) for t in inputs]
    target_nodes = {n for n, _ in targets}
    captured: dict[tuple[Any, int], torch.Tensor | None] = {}
    deps = _dependencies(starts)
    ready = [n for n in dict.fromkeys(starts) if deps[n] == 0]
    previous = (at.current_node, at.use_engine_node)
    at.use_engine_node = False
    # one graph task for checkpoint's unpack hooks, as the engine's: without it each saved tensor
    # a non-reentrant checkpoint unpacks recomputes the whole region again
    outer = torch.utils.checkpoint.GraphExecGroup._get_current_group()
    group = torch.utils.checkpoint.GraphExecGroup() if outer is None else contextlib.nullcontext()
    try:
        with torch.no_grad(), group:
            while ready:
                node = ready.pop()
                got = buffers.pop(node, [])
                if node in target_nodes:
                    for n, nr in targets:
                        if n is node:
                            captured[(n, nr)] = got[nr] if nr < len(got) else None
                if not accumulate and node.name() == "torch::autograd::AccumulateGrad":
                    continue
                n_in = len(node._input_metadata)
                got = _run_tensor_hooks(at, node, got + [None] * (n_in - len(got)))
                if isinstance(node, torch.autograd.function.BackwardCFunction):
                    got = _materialized(node, got)
                at.current_node = node
                outs = node(*got) if callable(node) else node.apply(*got)
                if outs is None or isinstance(outs, torch.Tensor):
                    outs = (outs,)
                for (nxt, nr), g in zip(node.next_functions, outs, strict=False):
                    if nxt is None:
                        continue
                    if isinstance(g, torch.Tensor):
                        meta = nxt._input_metadata
                        if nr < len(meta):
                            # what the engine's validate_outputs does: reduce broadcasts, cast dtypes
                            want = meta[nr]
                            if tuple(want.shape) != tuple(g.shape):
                                g = g.sum_to_size(want.shape)
                            if want.dtype != g.dtype:
                                g = g.to(want.dtype)
                        add(nxt, nr, g)
                    deps[nxt] -= 1
                    if deps[nxt] == 0:
                        ready.append(nxt)
    finally:
        at.current_node, at.use_engine_node = previous
    return tuple(captured.get(t) for t in targets) if not accumulate else ()


def _materialized(node: Any, grads: list[Any]) -> list[Any]:
    """A custom Function's missing gradients as zeros, as the engine gives them to its backward
    (torch.utils.checkpoint's reentrant backward refuses a None one). A Function that turned this
    off (``ctx.set_materialize_grads(False)``, unreadable from Python) reads None as zeros too."""
    return [
        torch.zeros(tuple(m.shape), dtype=m.dtype, device=m.device) if g is None and not m.is_nested_tensor else g
        for g, m in zip(grads, node._input_metadata, strict=False)
    ]


def _run_tensor_hooks(at: Attribution, node: Any, grads: list[Any]) -> list[Any]:
    """The tensor hooks on the gradients ``node`` is about to take, as the engine runs them: a
    leaf's on its AccumulateGrad node, a non-leaf's on its grad_fn (recorded at registration, as
    the node keeps them out of Python's reach). A hook returning another dtype is refused with the
    engine's own error."""
    leaf = getattr(node, "variable", None) if node.name() == "torch::autograd::AccumulateGrad" else None
    for nr, g in enumerate(grads):
        hooks = getattr(leaf, "_backward_hooks", None) if leaf is not None else _TENSOR_HOOKS.get((node, nr))
        if not hooks or not isinstance(g, torch.Tensor):
            continue
        for hook in list(hooks.values()):
            out = hook(g)
            if out is None:
                continue
            if out.dtype != g.dtype:
                from castwise.devices import get as get_device  # only on the way to the error
                from castwise.trace.contracts._base import _legacy

                dev = get_device(at.device_type)
                raise RuntimeError(
                    f"hook '{getattr(hook, '__name__', type(hook).__name__)}' has changed the type of value "
                    f"(was {_legacy(g.dtype, dev)} got {_legacy(out.dtype, dev)})"
                )
            g = out
        grads[nr] = g
    return grads


# (grad_fn, output_nr) -> the tensor's hook dict, for tensors given hooks during a run whose
# backward runs without the engine (set and cleared by tensor_hooks_recorded)
_TENSOR_HOOKS: dict[tuple[Any, int], Any] = {}


@contextmanager
def tensor_hooks_recorded() -> Iterator[None]:
    """Remember which autograd edge each non-leaf tensor hook belongs to, for :func:`python_backward`."""
    original = torch.Tensor.register_hook

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        handle = original(self, hook)  # type: ignore[no-untyped-call]
        if self.grad_fn is not None:
            _TENSOR_HOOKS[(self.grad_fn, self.output_nr)] = self._backward_hooks
        return handle

    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]
        _TENSOR_HOOKS.clear()


def _dependencies(starts: list[Any]) -> dict[Any, int]:
    """How many edges lead into each node reachable from ``starts`` (a node runs when all have)."""
    deps: dict[Any, int] = collections.defaultdict(int)
    seen = set(starts)
    todo = list(starts)
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            deps[nxt] += 1
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return deps


@contextmanager
def engine_replaced(at: Attribution) -> Iterator[None]:
    """Route ``backward()`` and ``autograd.grad()`` (also inside custom backward functions)
    through :func:`python_backward` for the duration of a fake-CUDA audit."""
    import torch.autograd as autograd_pkg

    original = getattr(autograd_pkg, "_engine_run_backward")  # noqa: B009

    def substitute(
        t_outputs: Any,
        grad_tensors: Any,
        keep_graph: Any = None,
        create_graph: Any = None,
        inputs: Any = (),
        allow_unreachable: Any = True,
        accumulate_grad: bool = True,
        **kwargs: Any,
    ) -> tuple[torch.Tensor | None, ...]:
        return python_backward(at, list(t_outputs), list(grad_tensors), tuple(inputs or ()), accumulate_grad)

    setattr(autograd_pkg, "_engine_run_backward", substitute)  # noqa: B010
    try:
        yield
    finally:
        setattr(autograd_pkg, "_engine_run_backward", original)  # noqa: B010
