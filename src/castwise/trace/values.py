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
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from castwise.trace.events import Trace

_SHADOW_MAX = 1 << 16  # elements: values are kept for small tensors only (masks, ids, positions)
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
    """Mixed into the tracer: ``shadow`` maps a fake tensor to a real CPU tensor with its values."""

    shadow: Any
    shadow_count: int
    trace: Trace
    forced: frozenset[tuple[str, int]] = frozenset()  # branch sites this run answers True

    def branch_value(self, func: Any, tensors: list[torch.Tensor], module: str) -> Any:
        """A truth value no shadow knows: False, or True at a ``forced`` site; the site is recorded
        in ``trace.observed["branches"]``. NO_VALUE for a number (``.item()`` of a count) or a
        tensor that is not fake: those stop the run as before."""
        if func._opname not in _BOOL_SCALARS or len(tensors) != 1:
            return NO_VALUE
        t = tensors[0]
        if type(t).__name__ != "FakeTensor" or (func._opname == "_local_scalar_dense" and t.dtype != torch.bool):
            return NO_VALUE
        file, line, text = branch_site()
        sites: dict[tuple[str, int], dict[str, Any]] = self.trace.observed.setdefault("branches", {})
        site = sites.get((file, line))
        if site is None:
            site = sites[(file, line)] = {
                "file": file,
                "line": line,
                "source": text,
                "module": module,
                "answers": {False: 0, True: 0},
            }
        value = (file, line) in self.forced and site["answers"][True] < _LOOP_LIMIT
        site["answers"][value] += 1
        return value

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

        def real(x: Any) -> Any:
            nonlocal missing
            if isinstance(x, torch.Tensor):
                value = self.shadow.get(x)
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

    def _shadow_value(
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

    def _shadow_run(
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
