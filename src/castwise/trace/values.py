"""Real values for small fake tensors: masks, ids and positions; and branches on unknown values.

Fake tensors have no values. Tensors derived only from the inputs and small constants keep a
real CPU copy of their values, so value-dependent code (``if mask.all():``, the encoder's
left-aligned mask check) runs as it would for real instead of stopping the fake run.

A truth value no shadow knows (``if torch.isinf(h).any():`` on activations, BART's fp16 clamp)
is a *branch*: the run goes on with it False, and records the site (the model's source line).
The audit then runs the mode again with every recorded site True (``forced``), so both sides of
each branch are checked; the report says which ran and whether the other was checked. A site
answered True more than ``_LOOP_LIMIT`` times in one run answers False, so ``while x.any():``
loops end.

Sizes and numbers no shadow knows (``x[mask]``, ``nonzero``, ``int(n.sum().item())``) are computed
from what made the tensor (a *recipe*, kept for masks, counts and ids and what is made from them)
when the values behind it are known; a mask whose values nobody knows is taken as all True (the
largest result), a number as 1. Each assumption is recorded (``trace.sizes``, CW903)
and the run goes on: ``trace/datadep.py`` runs the ops whose output size depends on values.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from castwise.trace.attrmap import AttrMap
from castwise.trace.events import Trace

_SHADOW_MAX = 1 << 16  # elements: values are kept for small tensors only (masks, ids, positions)
_KNOWN_MAX = 1 << 22  # elements: the largest tensor computed for real to answer a size or value question
_DEPTH = 48  # recipes followed back from one question
_SIZES_MAX = 64  # assumption records kept per run (a `.tolist()` loop asks once per element)
# tensors whose values decide sizes: their recipes are kept (and those of anything made from them)
_VALUE_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
NO_VALUE = object()
_LOOP_LIMIT = 64
_BOOL_SCALARS = ("is_nonzero", "_local_scalar_dense")
# frames that are not the model's: castwise's own and torch's
_OWN = (os.path.dirname(os.path.dirname(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)


@contextlib.contextmanager
def one_thread(enabled: bool = True) -> Iterator[None]:
    """Torch's intra-op threads limited to one while a fake run lasts, then restored.

    The only real kernels a fake run calls are the shadows' (masks, ids: tens of elements), and
    a parallel kernel on a busy machine waits for a worker thread to be scheduled (measured:
    ``tril`` of a 16x16 bool mask, 2 µs on one thread, 18 ms on two with the cores loaded), and
    workers left spinning after it slow every op that follows."""
    before = torch.get_num_threads()
    if not enabled or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def branch_site() -> tuple[str, int, str]:
    """The model's source line asking for the value: (file, line, source text)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_OWN) and not name.startswith("<"):
            return name, frame.f_lineno, linecache.getline(name, frame.f_lineno).strip()
        frame = frame.f_back  # type: ignore[assignment]
    return "?", 0, ""


class ShadowValues:
    """A part of the eager producer: ``shadow`` maps a fake tensor to a real CPU tensor with its values."""

    def __init__(
        self, trace: Trace, module: Callable[[], str], forced: frozenset[tuple[str, int]] = frozenset()
    ) -> None:
        self.trace = trace  # where branches and assumptions are recorded
        self.module = module  # the module running now (attribution's)
        self.forced = forced  # branch sites this run answers True
        self.shadow = AttrMap("value")  # fake tensor -> real CPU tensor with its values
        self.shadow_count = 0
        # fake mask/count/id tensor -> (func, args, kwargs, output index) that made it; None: changed in place
        self.recipe = AttrMap("recipe")
        self.assumed_now = 0  # masks taken as all True by ``known`` (callers read it to record the assumption)

    def remember(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor], out: Any
    ) -> None:
        """Keep how a mask, count or id tensor was made (and anything made from one), so a size or
        number asked of it later is computed from the values behind it. Cheap for the rest: one
        dtype test and a lookup per input."""
        if isinstance(out, torch.Tensor):
            outs: Any = ((out, None),)
        elif isinstance(out, (tuple, list)):  # unbind (``.tolist()``), sort, topk...
            outs = [(o, i) for i, o in enumerate(out) if isinstance(o, torch.Tensor)]
        else:
            return
        recipe = self.recipe
        fed = None  # made from a tensor that has a recipe: asked once, for all outputs
        for o, index in outs:
            if o in self.shadow:
                continue
            if o.dtype not in _VALUE_DTYPES:
                if fed is None:
                    fed = any(t in recipe for t in tensors)
                if not fed:
                    continue
            # changed in place: what made it no longer says what it holds
            recipe[o] = None if func._schema.is_mutable else (func, args, kwargs, index)

    def known(self, t: torch.Tensor, *, assume: bool, depth: int = 0) -> torch.Tensor | None:
        """``t``'s real values: its shadow, or computed from its recipe when the values behind it are
        known. With ``assume``, a mask (bool) whose values nobody knows is taken as all True, the
        largest result (``assumed_now`` counts it). None: unknown, or too large to compute."""
        value: Any = self.shadow.get(t)
        if value is not None:
            return value  # type: ignore[no-any-return]
        if depth == 0:
            self._unknown: set[int] = set()  # found unknown in this question: each tensor is asked once
        elif id(t) in self._unknown:
            return None
        if type(t).__name__ != "FakeTensor":  # a real constant made in forward is its own value
            return t if t.device.type == "cpu" and not t.is_nested else None
        if t.numel() > _KNOWN_MAX:
            return None
        made = self.recipe.get(t)
        if made is not None and depth < _DEPTH:
            value = self._recompute(made, assume, depth)
            if not isinstance(value, torch.Tensor) or value.shape != t.shape:
                value = None
        if value is None and assume and t.dtype == torch.bool:
            with _disable_current_modes():
                value = torch.ones(tuple(t.shape), dtype=torch.bool)
            self.assumed_now += 1
        if value is None:
            self._unknown.add(id(t))
            return None
        self.shadow[t] = value
        self.shadow_count += 1
        return value  # type: ignore[no-any-return]

    def _recompute(self, made: tuple[Any, Any, Any, int | None], assume: bool, depth: int) -> Any:
        func, args, kwargs, index = made
        missing = False

        def real(x: Any) -> Any:
            nonlocal missing
            if missing:  # one unknown input is enough: the rest are not asked
                return None
            if isinstance(x, torch.Tensor):
                value = self.known(x, assume=assume, depth=depth + 1)
                missing = value is None
                return value
            return torch.device("cpu") if isinstance(x, torch.device) else x

        new_args, new_kwargs = tree_map(real, (args, kwargs))
        if missing:
            return None
        if "device" in new_kwargs:
            new_kwargs["device"] = torch.device("cpu")
        try:
            with _disable_current_modes():
                value = func(*new_args, **new_kwargs)
            return value if index is None else value[index]
        except Exception:  # a value we cannot compute is a value we do not know
            return None

    def note_assumption(self, op: str, what: str, shape: tuple[int, ...]) -> None:
        """Record a value the run assumed (CW903 lists them; an error after one is not the model's)."""
        sizes = self.trace.sizes
        entry = {"module": self.module(), "op": op, "shape": shape, "assumed": what}
        if len(sizes) < _SIZES_MAX and entry not in sizes:
            sizes.append(entry)

    def branch_value(self, func: Any, tensors: list[torch.Tensor], module: str) -> Any:
        """A value no shadow knows (``.item()``, ``bool()``), computed from its recipe when the
        values behind it are known. Else a truth value is a branch: False, or True at a ``forced``
        site; the site is recorded in ``trace.branches``. A number is computed with
        unknown masks taken as all True, else taken as 1 (recorded). NO_VALUE for a tensor that is
        not fake or a value of another kind: those stop the run as before."""
        if func._opname not in _BOOL_SCALARS or len(tensors) != 1:
            return NO_VALUE
        t = tensors[0]
        if type(t).__name__ != "FakeTensor" or t.numel() != 1:
            return NO_VALUE
        value = self.known(t, assume=False)
        if value is not None:
            with _disable_current_modes():
                return func(value)
        if func._opname == "_local_scalar_dense" and t.dtype != torch.bool:
            return self._number(func, t)
        file, line, text = branch_site()
        sites = self.trace.branches
        site = sites.get((file, line))
        if site is None:
            site = sites[(file, line)] = {
                "file": file,
                "line": line,
                "source": text,
                "module": module,
                "answers": {False: 0, True: 0},
            }
        answer = (file, line) in self.forced and site["answers"][True] < _LOOP_LIMIT
        site["answers"][answer] += 1
        return answer

    def _number(self, func: Any, t: torch.Tensor) -> Any:
        """A number no shadow knows (``int(mask.sum().item())``): computed with unknown masks taken
        as all True, else 1 (a size of one, never zero: the ops after it still run)."""
        if t.dtype.is_complex:
            return NO_VALUE
        before = self.assumed_now
        value = self.known(t, assume=True)
        if value is not None:
            if self.assumed_now != before:
                self.note_assumption("aten._local_scalar_dense", "a mask with unknown values taken as all True", ())
            with _disable_current_modes():
                return func(value)
        self.note_assumption("aten._local_scalar_dense", "a number fake tensors have no value for taken as 1", ())
        return 1.0 if t.dtype.is_floating_point else 1

    def seed_values(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with _disable_current_modes():  # real copies, even when called inside the fake mode
            for fake, real in pairs:
                if real.numel() <= _SHADOW_MAX and real.device.type == "cpu":
                    self.shadow[fake] = real.detach().clone()  # in-place ops must not reach the caller's
                    self.shadow_count += 1

    def value_of(self, t: torch.Tensor) -> torch.Tensor | None:
        found: torch.Tensor | None = self.shadow.get(t)
        return found

    def _real_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        missing = False
        find = self.shadow.get

        def real(x: Any) -> Any:
            nonlocal missing
            if isinstance(x, torch.Tensor):
                value = find(x)
                if value is None:
                    missing = True
                return value
            if isinstance(x, torch.device):
                return torch.device("cpu")
            return x

        out = tree_map(real, (args, kwargs))
        if missing:
            return None
        new_args, new_kwargs = out
        if "device" in new_kwargs:
            new_kwargs["device"] = torch.device("cpu")
        return new_args, new_kwargs

    def shadow_value(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]
    ) -> Any:
        mapped = self._real_args(args, kwargs) if tensors else None
        if mapped is None:
            return NO_VALUE
        try:
            with _disable_current_modes():
                return func(*mapped[0], **mapped[1])
        except Exception:
            return NO_VALUE

    def shadow_run(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor], out: Any
    ) -> None:
        shadow = self.shadow
        key = shadow.key
        for t in tensors:  # first: the cheap test that fails for most ops (a dict hit per tensor)
            if key not in t.__dict__:
                return
        outs = (
            [out]
            if isinstance(out, torch.Tensor)
            else [o for o in out if isinstance(o, torch.Tensor)]
            if isinstance(out, (tuple, list))
            else []
        )
        if not outs or any(o.is_nested or o.numel() > _SHADOW_MAX for o in outs) or (func.is_view and not tensors):
            return
        if not tensors and func._schema.is_mutable:
            return
        mapped = self._real_args(args, kwargs)
        if mapped is None:
            return
        try:
            with _disable_current_modes():
                real = func(*mapped[0], **mapped[1])
        except Exception:  # a value we cannot compute is a value we do not know
            return
        reals = (
            [real]
            if isinstance(real, torch.Tensor)
            else [r for r in real if isinstance(r, torch.Tensor)]
            if isinstance(real, (tuple, list))
            else []
        )
        for o, r in zip(outs, reals, strict=False):
            if o not in self.shadow:
                self.shadow[o] = r
                self.shadow_count += 1
