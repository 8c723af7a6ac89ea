"""The compiled program as a run record: the ATen graphs AOTAutograd made, walked node by node.

Dynamo and AOTAutograd leave on each graph node the user's module (``nn_module_stack``; in
backward ``fwd_nn_module_stack``), the source line (``stack_trace``) and a fake value (``val``:
dtype, shape). Walking a graph's nodes in order gives what the dispatch-mode tracer records of
the eager program: each aten op checked against the same contract table, the provenance of
every value (``trace/provenance.py``, the functions the tracer calls), and the ops as rows. Pure functions of the graph:
nothing here runs an op.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from castwise._paths import short_path
from castwise.devices import Device
from castwise.trace import contracts, provenance, source
from castwise.trace.events import Event, Phase, Prov, shape_of
from castwise.trace.opinfo import info_of
from castwise.trace.record import Recorder

_HEAD = re.compile(r"^[LG]\['[^']*'\]")  # L['self']: the compiled frame's local the path starts at
_INDEX = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")  # [0] / ['layers'] -> .0 / .layers
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def module_name(fqn: str, known: Container[str], prefix: str = "") -> str:
    """The user's module name (as ``named_modules()`` gives it) of a Dynamo module path:
    ``L['self'].layers[0].attn`` or ``L['self']._modules['layers']._modules['0']`` give
    ``layers.0.attn`` / ``layers.0``. ``_orig_mod`` (a compiled submodule's wrapper) is never
    part of a name the user sees."""
    path = _INDEX.sub(r".\1", _HEAD.sub("", fqn))
    # ``prefix``: the compiled block's own name, where its graph's paths start (a block compiled alone)
    parts = [p for p in f"{prefix}.{path}".split(".") if p and p not in ("_modules", "_orig_mod")]
    while parts and ".".join(parts) not in known:
        parts.pop()  # a path into a non-module attribute: its module
    return ".".join(parts)


def user_line(stack_trace: str | None) -> str | None:
    """``"models/rope.py:42"``: the innermost frame of a node's stack trace that is the user's."""
    if not stack_trace:
        return None
    found = [(f, int(n)) for f, n in _FILE_LINE.findall(stack_trace) if not source.is_plumbing(f)]
    return f"{short_path(found[-1][0])}:{found[-1][1]}" if found else None


def autocast_regions(gm: fx.GraphModule, device_type: str) -> dict[str, torch.dtype | None]:
    """The autocast dtype (None: off) each node of a Dynamo graph runs under, on ``device_type``.

    Dynamo leaves the program's autocast changes in the graph as nodes: ``torch.autocast``
    blocks as ``_enter_autocast``/``_exit_autocast`` (a graph resumed after a break inside one
    enters it again at its start), and direct state changes (``set_autocast_enabled`` /
    ``set_autocast_dtype``, as castwise's mixed policies make them) as themselves. The state at
    the graph's entry is the one around the compile."""
    enabled = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type)
    saved: list[tuple[bool, torch.dtype]] = []
    regions: dict[str, torch.dtype | None] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        what = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        args = node.args
        if what == "_enter_autocast" and len(args) >= 3 and args[0] == device_type:
            saved.append((enabled, dtype))
            enabled, dtype = bool(args[2]), args[1] if isinstance(args[1], torch.dtype) else dtype
        elif what == "_exit_autocast" and saved and _entered_on(args, device_type):
            enabled, dtype = saved.pop()
        elif what == "set_autocast_enabled" and len(args) == 2 and args[0] == device_type:
            enabled = bool(args[1])
        elif what == "set_autocast_dtype" and len(args) == 2 and args[0] == device_type:
            dtype = args[1]
        regions[node.name] = dtype if enabled else None
    return regions


def _entered_on(args: tuple[Any, ...], device_type: str) -> bool:
    """Whether an ``_exit_autocast`` closes a block entered on ``device_type``."""
    entered = args[0] if args else None
    return isinstance(entered, fx.Node) and bool(entered.args) and bool(entered.args[0] == device_type)


def _source_name(node: fx.Node) -> str | None:
    """The Dynamo graph node an AOTAutograd node was traced from (``from_node``)."""
    sources = node.meta.get("from_node")
    name = getattr(sources[0], "name", None) if sources else None
    return name if isinstance(name, str) else None


def _module_of(node: fx.Node, known: Container[str], prefix: str = "") -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    return module_name(str(fqn), known, prefix)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


@dataclass
class GraphWalk:
    """Walks one run's graphs in execution order into its record; ``provs`` by node name
    per graph, so a backward graph's saved values keep their forward origins."""

    recorder: Recorder
    device: Device
    known: frozenset[str]
    autocast: torch.dtype | None  # the autocast dtype the compiled program ran under (the policy's)
    ops: int = 0
    on_op: list[Callable[[str, Phase, fx.Node], None]] = field(default_factory=list)
    # per Dynamo node, the autocast it ran under (``autocast_regions`` of the graph being compiled)
    regions: dict[str, torch.dtype | None] | None = None
    prefix: str = ""  # the name of the block whose graphs are walked (a block compiled on its own)

    def autocast_of(self, node: fx.Node) -> torch.dtype | None:
        """The autocast a forward node ran under: its Dynamo node's region where the graph says,
        else the run's."""
        name = _source_name(node) if self.regions is not None else None
        if self.regions is None or name is None or name not in self.regions:
            return self.autocast
        return self.regions[name]

    def walk(self, gm: fx.GraphModule, phase: Phase, seeds: dict[str, Prov | None]) -> dict[str, Prov | None]:
        """Check every aten op of ``gm``; ``seeds``: the placeholders' provenance, by name."""
        provs: dict[str, Prov | None] = dict(seeds)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                provs.setdefault(node.name, None)
            elif node.op == "call_function":
                provs[node.name] = self._node(node, phase, provs)
        return provs

    def _node(self, node: fx.Node, phase: Phase, provs: dict[str, Prov | None]) -> Prov | None:
        ins = [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
        if not isinstance(node.target, torch._ops.OpOverload):
            # getitem of a multi-output op, and Python glue: the first operand's origin
            return provs.get(ins[0].name) if ins else None
        func = node.target
        name = info_of(func).name
        module = _module_of(node, self.known, self.prefix)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), _val)
        tensors = [_val(a) for a in ins]
        found = contracts.lookup(func, self.device)
        if not found.covered:
            self.recorder.uncovered(name, module)
        # the real program raises at its first refused op: nothing after it runs, so nothing after
        # it is checked (Dynamo's fake propagation goes on where a real kernel would not)
        violation = found.check(args, kwargs) if not self.recorder.trace.events else None
        self.ops += 1
        if violation is not None:
            self.recorder.event(self._event(node, phase, module, name, violation, provs))
        outs = [t for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
        prov = self._propagate(node, phase, module, name, ins, outs, provs)
        self.recorder.op(module, name, phase, tensors, outs)
        for hook in self.on_op:
            hook(module, phase, node)
        return prov

    def _event(
        self, node: fx.Node, phase: Phase, module: str, name: str, violation: Any, provs: dict[str, Prov | None]
    ) -> Event:
        leaves = tree_leaves((node.args, node.kwargs))
        operands = [a for a in leaves if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor)]
        vals = [_val(a) for a in operands]
        return Event(
            phase,
            module,
            name,
            violation,
            None,
            tuple(t.dtype for t in vals),
            tuple(shape_of(t) for t in vals),
            tuple(provs.get(a.name) for a in operands),
            self.autocast_of(node) if phase == "forward" else None,
            False,
        )

    def _propagate(
        self,
        node: fx.Node,
        phase: Phase,
        module: str,
        name: str,
        ins: list[fx.Node],
        outs: list[torch.Tensor],
        provs: dict[str, Prov | None],
    ) -> Prov | None:
        if not outs:
            return None
        out = outs[0]
        forward = phase == "forward"
        cast = name in provenance.CASTS
        operands = [(provs.get(a.name), _val(a)) for a in ins]
        found = [(p, t) for p, t in operands if p is not None and t.dtype == out.dtype]
        chosen = provenance.kept(found, len(ins) > 1, name, module, out, cast=cast, forward=forward)
        if chosen is not None:
            return chosen
        return provenance.made(
            name,
            module,
            out,
            operands,
            cast=cast,
            forward=forward,
            autocast=self.autocast_of(node) if forward else None,
            line=lambda: user_line(node.meta.get("stack_trace")),
        )


__all__ = ["GraphWalk", "autocast_regions", "module_name", "user_line"]
