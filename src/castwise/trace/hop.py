"""Higher-order operators (``torch.cond``, ``while_loop``, ``flex_attention``...) met by the tracer.

torch routes a higher-order operator to a dispatch mode's ``__torch_dispatch__`` only when the
mode says it supports them; without that it raises "no rule registered for HigherOrderOperator",
which the audit reported as the model's error (CW130) while the model runs.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from castwise.trace.record import Recorder


def is_hop(func: Any) -> bool:
    return isinstance(func, HigherOrderOperator)


def run_hop(
    mode: TorchDispatchMode,
    recorder: Recorder,
    func: HigherOrderOperator,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``torch.cond``: both branches run under ``mode`` (the tracer, re-entered), so each op of
    either is checked: a fake predicate has no value, and either branch may run for real. The
    result is the true branch's (cond requires both to give the same dtypes and shapes). Other
    operators run as they are, below the mode: their inner ops are not checked, and the run lists
    them as uncovered (``uncovered``: the tracer's map of op name to modules)."""
    name = str(func._name)  # name() is untyped in torch
    if name == "cond" and len(args) == 4 and not kwargs:
        _CONDS[0] += 1
        _pred, true_fn, false_fn, operands = args
        with mode:
            out = true_fn(*operands)
            false_fn(*operands)
        return out
    recorder.uncovered(f"higher_order.{name}", "")
    return func(*args, **kwargs)


_CONDS = [0]  # torch.cond calls run under a tracer in this process


@contextlib.contextmanager
def eager_cond_restored() -> Iterator[None]:
    """Eager ``torch.cond`` compiles a wrapper with Dynamo, which skips that frame for good where a
    dispatch mode (the tracer) is active (torch 2.12: every later real ``torch.cond`` in the
    process then raises "torch.* op returned non-Tensor"). After a run that met a cond, Dynamo
    forgets the wrapper's code, as before the run."""
    before = _CONDS[0]
    try:
        yield
    finally:
        if _CONDS[0] != before:
            _forget_cond_wrapper()


def _forget_cond_wrapper() -> None:
    module = sys.modules.get("torch._higher_order_ops.cond")
    cond = getattr(module, "cond", None)
    if cond is None or not hasattr(cond, "__code__"):
        return
    from torch._dynamo import eval_frame

    reset_code = getattr(eval_frame, "reset_code", None)  # C: Dynamo's per-code cache and skip mark
    for code in _nested(cond.__code__):
        if code.co_name == "_cond_op_wrapper" and reset_code is not None:
            reset_code(code)


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const
            yield from _nested(const)


__all__ = ["eager_cond_restored", "is_hop", "run_hop"]
