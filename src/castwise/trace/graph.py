"""The compiled program as a run record: the ATen graphs AOTAutograd made, walked node by node.

Dynamo and AOTAutograd leave on each graph node the user's module (``nn_module_stack``; in
backward ``fwd_nn_module_stack``), the source line (``stack_trace``) and a fake value (``val``:
dtype, shape). Walking a graph's nodes in order gives what the dispatch-mode tracer records of
the eager program: each aten op checked against the same contract table, the provenance of
every value (the same rule as the tracer's: an output keeps the origin of an operand of its
dtype, else it is where its dtype was made), and the ops as rows. Pure functions of the graph:
nothing here runs an op.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from castwise._dtypes import fmt_tensor, name_of
from castwise._paths import short_path
from castwise.devices import Device
from castwise.trace import contracts, source
from castwise.trace.events import Event, Phase, Prov, Trace, shape_of
from castwise.trace.opinfo import info_of

_HEAD = re.compile(r"^[LG]\['[^']*'\]")  # L['self']: the compiled frame's local the path starts at
_INDEX = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")  # [0] / ['layers'] -> .0 / .layers
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_RANK = {"autocast": 0, "param": 1, "buffer": 1}  # the tracer's: which operand's origin an output keeps
# a cast: `.to()` / `.float()` in the user's code, or autocast's cast of an op's operands
_CASTS = frozenset({"aten._to_copy", "prims.convert_element_type", "aten.to"})


def module_name(fqn: str, known: Container[str]) -> str:
    """The user's module name (as ``named_modules()`` gives it) of a Dynamo module path:
    ``L['self'].layers[0].attn`` or ``L['self']._modules['layers']._modules['0']`` give
    ``layers.0.attn`` / ``layers.0``. ``_orig_mod`` (a compiled submodule's wrapper) is never
    part of a name the user sees."""
    path = _INDEX.sub(r".\1", _HEAD.sub("", fqn))
    parts = [p for p in path.split(".") if p and p not in ("_modules", "_orig_mod")]
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


def _module_of(node: fx.Node, known: Container[str]) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    return module_name(str(fqn), known)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


@dataclass
class GraphWalk:
    """Walks one run's graphs in execution order into its :class:`Trace`; ``provs`` by node name
    per graph, so a backward graph's saved values keep their forward origins."""

    trace: Trace
    device: Device
    known: frozenset[str]
    autocast: torch.dtype | None  # the autocast dtype the compiled program ran under (the policy's)
    record_ops: bool = True
    ops: int = 0
    on_op: list[Callable[[str, Phase, fx.Node], None]] = field(default_factory=list)
    # per Dynamo node, the autocast it ran under (``autocast_regions`` of the graph being compiled)
    regions: dict[str, torch.dtype | None] | None = None

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
        module = _module_of(node, self.known)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), _val)
        tensors = [_val(a) for a in ins]
        found = contracts.lookup(func, self.device)
        if not found.covered:
            self.trace.uncovered.setdefault(name, set()).add(module)
        # the real program raises at its first refused op: nothing after it runs, so nothing after
        # it is checked (Dynamo's fake propagation goes on where a real kernel would not)
        violation = found.check(args, kwargs) if not self.trace.events else None
        self.ops += 1
        if violation is not None:
            self.trace.events.append(self._event(node, phase, module, name, violation, provs))
        outs = _tensors(node.meta.get("val"))
        prov = self._propagate(node, phase, module, name, ins, outs, provs)
        if self.record_ops:
            self.trace.ops.append(
                (
                    module,
                    name,
                    phase,
                    tuple((t.dtype, shape_of(t)) for t in tensors),
                    tuple((o.dtype, shape_of(o)) for o in outs),
                )
            )
        for hook in self.on_op:
            hook(module, phase, node)
        return prov

    def _event(
        self, node: fx.Node, phase: Phase, module: str, name: str, violation: Any, provs: dict[str, Prov | None]
    ) -> Event:
        operands = [a for a in _flat_nodes((node.args, node.kwargs)) if isinstance(_val(a), torch.Tensor)]
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
        dtype = outs[0].dtype
        chosen: Prov | None = None
        rank = 9
        for a in ins:
            p = provs.get(a.name)
            if p is None or _val(a).dtype != dtype:
                continue
            r = _RANK.get(p.kind, 2)
            if r < rank:
                chosen, rank = p, r
        if chosen is not None:
            return chosen
        desc = fmt_tensor(name_of(dtype), shape_of(outs[0]))
        if phase != "forward":
            return Prov("backward", module, name, desc, dtype)
        line = user_line(node.meta.get("stack_trace")) if outs[0].is_floating_point() else None
        if name in _CASTS and ins:
            # inside autocast a cast is autocast's (the tracer says the same of a cast it sees there)
            if self.autocast_of(node) is not None:
                return Prov("autocast", module, name, desc, dtype)
            return Prov("cast", module, name, desc, dtype, line)
        if not ins:
            return Prov("created", module, name, desc, dtype, line)
        mixed = tuple(
            p
            for a in ins
            if _val(a).is_floating_point() and _val(a).dtype != dtype and (p := provs.get(a.name)) is not None
        )
        return Prov("op", module, name, desc, dtype, line, promoted=mixed)


def _flat_nodes(obj: Any) -> list[fx.Node]:
    if isinstance(obj, fx.Node):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [n for x in obj for n in _flat_nodes(x)]
    if isinstance(obj, dict):
        return [n for x in obj.values() for n in _flat_nodes(x)]
    return []


__all__ = ["GraphWalk", "autocast_regions", "module_name", "user_line"]
