"""Backward without the autograd engine, for simulated devices.

The engine needs a CUDA context for CUDA tensors, which a CPU-only machine cannot create, even
for fake ones. Calling the autograd nodes directly runs the same backward formulas and tells the
tracer which node runs, for attribution.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from castwise.trace.tracer import Tracer


def _edge(t: Any) -> tuple[Any, int]:
    if isinstance(t, torch.Tensor):
        edge = torch.autograd.graph.get_gradient_edge(t)
        return edge.node, edge.output_nr
    return t.node, t.output_nr  # a GradientEdge


def python_backward(
    tracer: Tracer, roots: Any, grads: Any, inputs: Any = (), accumulate: bool = True
) -> tuple[torch.Tensor | None, ...]:
    """Backward without the autograd engine, node by node (what ``torch.autograd.backward`` and
    ``torch.autograd.grad`` do, minus hooks and streams).

    The engine needs a CUDA context for CUDA tensors, which a CPU-only machine cannot create,
    even for fake ones; calling the nodes directly runs the same backward formulas, and tells
    which node runs, for attribution. Tensor and node hooks are not run this way.
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
    previous = (tracer.current_node, tracer.use_engine_node)
    tracer.use_engine_node = False
    try:
        with torch.no_grad():
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
                got = got + [None] * (n_in - len(got))
                tracer.current_node = node
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
        tracer.current_node, tracer.use_engine_node = previous
    return tuple(captured.get(t) for t in targets) if not accumulate else ()


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
def engine_replaced(tracer: Tracer) -> Iterator[None]:
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
        return python_backward(tracer, list(t_outputs), list(grad_tensors), tuple(inputs or ()), accumulate_grad)

    setattr(autograd_pkg, "_engine_run_backward", substitute)  # noqa: B010
    try:
        yield
    finally:
        setattr(autograd_pkg, "_engine_run_backward", original)  # noqa: B010
