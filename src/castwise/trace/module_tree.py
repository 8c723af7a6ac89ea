"""The report's module tree: each module's parameter dtypes and the dtypes it took and returned.

:class:`ModuleTreeObserver` hooks ``module_exit`` only (once per module call, never per op), so an
audit pays next to nothing for it. It stores a JSON-ready list in ``trace.modules``,
one dict per module in ``named_modules()`` order (parents before children)::

    {"name": "encoder.layers.0", "type": "TransformerEncoderLayer",
     "params": {"bf16": 1024},             # own parameters (not the children's): elements by dtype
     "inputs": ["bf16[2, 40, 32]"], "outputs": ["f32[2, 40, 32]"],   # first call: positional tensor
                                                                      # arguments, returned tensors
     "autocast": "bf16",                   # autocast dtype in force at the call, or None
     "calls": 2, "cast": true,             # floating outputs in a dtype no floating input had
     "upcast": true,                       # silent up-cast (CW120): low precision in, f32 out
     "raised": false}                      # the model raised while this module ran

A module that never ran has ``"calls": 0`` and empty inputs/outputs. The list is the whole tree:
the hierarchy is in the dotted names (``encoder`` is the parent of ``encoder.layers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from castwise._dtypes import fmt_tensor, name_of, short
from castwise.trace.attribution import tensors_of
from castwise.trace.observers import Observer

if TYPE_CHECKING:
    from torch import nn

    from castwise.trace.events import Frame, Trace
    from castwise.trace.observers import Run

_MAX_TENSORS = 4  # tensors listed per side: a module returning 40 cache tensors stays one line


class ModuleTreeObserver(Observer):
    """Records the module tree with parameter and activation dtypes (``trace.modules``)."""

    name = "modules"
    splices = True  # module exits are replayed for a reused block

    def __init__(self, model: nn.Module) -> None:
        # parameters are read once, before the run (the run does not change their dtypes)
        self._order: list[tuple[str, str, dict[str, int]]] = []
        for mname, module in model.named_modules():
            params: dict[str, int] = {}
            for p in module._parameters.values():
                if p is not None:
                    key = short(name_of(p.dtype))
                    params[key] = params.get(key, 0) + p.numel()
            self._order.append((mname, type(module).__name__, params))
        self._seen: dict[str, dict[str, Any]] = {}

    def module_exit(self, run: Run, frame: Frame, output: Any) -> None:
        seen = self._seen.get(frame.name)
        if seen is not None:
            seen["calls"] += 1
            return
        outs = tensors_of(output)
        # a cast is about floating tensors: token ids in and embeddings out is no cast
        in_dtypes = {t.dtype for t in frame.inputs if t.is_floating_point()}
        self._seen[frame.name] = {
            "inputs": _describe(frame.inputs),
            "outputs": _describe(outs),
            "autocast": None if frame.autocast is None else short(name_of(frame.autocast)),
            "calls": 1,
            "cast": bool(in_dtypes) and any(t.is_floating_point() and t.dtype not in in_dtypes for t in outs),
        }

    def finish(self, trace: Trace) -> None:
        upcast = {u.module for u in trace.upcasts}
        # the modules that were running when the model raised: they never returned
        raised = {f.name for f in trace.stack}
        for frame in trace.stack:
            if frame.name not in self._seen:
                self._seen[frame.name] = {
                    "inputs": _describe(frame.inputs),
                    "outputs": [],
                    "autocast": None if frame.autocast is None else short(name_of(frame.autocast)),
                    "calls": 1,
                }
        tree: list[dict[str, Any]] = []
        for mname, kind, params in self._order:
            seen = self._seen.get(mname, {})
            tree.append(
                {
                    "name": mname,
                    "type": kind,
                    "params": params,
                    "inputs": seen.get("inputs", []),
                    "outputs": seen.get("outputs", []),
                    "autocast": seen.get("autocast"),
                    "calls": seen.get("calls", 0),
                    "cast": seen.get("cast", False),
                    "upcast": mname in upcast,
                    "raised": mname in raised,
                }
            )
        trace.modules = tree


def _describe(tensors: list[Any]) -> list[str]:
    shown = [fmt_tensor(name_of(t.dtype), () if t.is_nested else tuple(t.shape)) for t in tensors[:_MAX_TENSORS]]
    if len(tensors) > _MAX_TENSORS:
        shown.append(f"+{len(tensors) - _MAX_TENSORS} more")
    return shown
