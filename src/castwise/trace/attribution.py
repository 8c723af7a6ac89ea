"""Attribution: which module an op belongs to, and in which phase it runs.

The eager producer holds one (as torch's ``module_tracker`` is one component of the modes that
use it): the module stack kept by *global* forward hooks (per-module hooks would change the code
path of TransformerEncoderLayer's fast path), the autocast dtype each module was entered under
(a dispatch handler cannot read autocast's state), the user hooks running, and the autograd nodes
tagged with the module that made their tensors, read back in backward. It writes no record and
calls no observer: a module's exit goes to the callback its producer gives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from castwise import _autocast
from castwise.trace.attrmap import AttrMap
from castwise.trace.events import Frame, Phase


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nested structure (a module's output, a batch), in the tree's order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [x for x in pytree.tree_leaves(obj) if isinstance(x, torch.Tensor)]


def disabled_by(stack: Sequence[Frame], dtypes: Sequence[torch.dtype], casts: Callable[[Frame], bool]) -> str | None:
    """The module whose forward turned autocast off around an op (or a raise), or None.

    A module entered with autocast on whose op (or child) runs without it turned it off in its
    forward: a child entered with autocast off, or an op that autocast casts (``casts`` of the
    innermost frame) meeting mixed floating operands. Autocast never casts float64 operands."""
    deepest = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].autocast is not None), None)
    if deepest is None:
        return None
    if deepest < len(stack) - 1:
        return stack[deepest].name
    floats = {d for d in dtypes if d.is_floating_point}
    mixed = len(floats) > 1 and torch.float64 not in floats
    return stack[deepest].name if mixed and casts(stack[deepest]) else None


class Attribution:
    """The module stack, hook stack, node tags and phase of one run."""

    def __init__(self, model: nn.Module, device_type: str, exited: Callable[[Frame, Any], None]) -> None:
        self.names: dict[int, str] = {id(m): n for n, m in model.named_modules()}
        self.device_type = device_type
        self.exited = exited  # a module's forward returned (forward phase): the producer tells observers
        self.creator = AttrMap("creator")  # tensor -> module that made it (kept on the run's own tensors)
        self.stack: list[Frame] = []
        self.phase: Phase = "forward"
        self.root_autocast: torch.dtype | None = None
        self.root_entered = 0  # castwise's autocast blocks open when the run began
        self.current_node: Any = None  # set by the Python backward walker (trace/backward.py)
        self.use_engine_node = True
        self.hook_stack: list[str] = []  # the user forward hooks running now (innermost last)
        self.refused: tuple[str, list[torch.Tensor]] | None = None  # (module, operands) sdpa refused

    # -- the phase protocol of one run (the eager run and numerics' layerwise run share it) ------

    @contextmanager
    def running(self) -> Iterator[None]:
        """One run: it starts in forward; on exit, also after a raise, the module stack is closed
        and the phase is forward again."""
        self.phase = "forward"
        try:
            yield
        finally:
            self.stack.clear()
            self.phase = "forward"

    def end_forward(self, out: Any) -> None:
        """The forward returned ``out``: its tensors' autograd nodes name the modules that made
        them (backward attributes its ops by them) and no module is running any more."""
        self.tag_outputs(out)
        self.stack.clear()

    def begin_backward(self) -> None:
        self.phase = "backward"

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """A forward run again inside backward (a block recomputed for its gradients)."""
        self.phase = "forward"
        try:
            yield
        finally:
            self.phase = "backward"

    # -- the module stack (global hooks) ---------------------------------------------------------

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        enabled = torch.is_autocast_enabled(self.device_type)
        dtype = torch.get_autocast_dtype(self.device_type) if enabled else None
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.stack.append(Frame(name, module, dtype, tensors, len(_autocast.ENTERED)))

    def _post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if id(module) not in self.names:
            return
        # pop to this module's frame (a child that raised inside a caught exception left its own)
        while self.stack:
            frame = self.stack.pop()
            if frame.module is module:
                break
        else:
            return
        if self.phase == "forward":
            self.exited(frame, output)

    @contextmanager
    def module_hooks(self) -> Iterator[None]:
        from torch.nn.modules import module as module_mod

        pre = module_mod.register_module_forward_pre_hook(self._pre_hook)
        post = module_mod.register_module_forward_hook(self._post_hook)
        try:
            yield
        finally:
            pre.remove()
            post.remove()

    def module(self) -> str:
        """The module running now: the top of the stack in forward, the tag of the autograd node
        running in backward."""
        if self.phase == "forward":
            return self.stack[-1].name if self.stack else ""
        node: Any = self.current_node if not self.use_engine_node else torch._C._current_autograd_node()
        if node is None:
            return ""
        found: str = node.metadata.get("castwise", "")
        return found

    def autocast_here(self) -> torch.dtype | None:
        if self.phase != "forward":
            return None
        frame = self.stack[-1] if self.stack else None
        # a block castwise entered inside this module's forward (a policy's root, an island) wins
        inside, dtype = _autocast.entered_since(frame.entered if frame else self.root_entered, self.device_type)
        if inside:
            return dtype
        return frame.autocast if frame else self.root_autocast

    # -- autograd node tags -------------------------------------------------------------------------

    def tag_nodes(self, tensors: list[torch.Tensor]) -> None:
        creator = self.creator
        for t in tensors:
            if t.requires_grad:
                node: Any = t.grad_fn
                if node is not None:
                    meta: dict[str, Any] = node.metadata
                    if "castwise" not in meta:
                        meta["castwise"] = creator.get(t, "")

    def tag_outputs(self, out: Any) -> None:
        """Tag the nodes of the model's outputs (never used as an op input inside forward)."""
        self.tag_nodes(tensors_of(out))
