"""Higher-order operators (``torch.cond``, ``while_loop``, ``flex_attention``...) met by the tracer.

torch routes a higher-order operator to a dispatch mode's ``__torch_dispatch__`` only when the
mode says it supports them; without that it raises "no rule registered for HigherOrderOperator",
which the audit reported as the model's error (CW130) while the model runs.
"""

from __future__ import annotations

from typing import Any

from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode


def is_hop(func: Any) -> bool:
    return isinstance(func, HigherOrderOperator)


def run_hop(mode: TorchDispatchMode, func: HigherOrderOperator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.cond``: both branches run under ``mode`` (the tracer, re-entered), so each op of
    either is checked: a fake predicate has no value, and either branch may run for real. The
    result is the true branch's (cond requires both to give the same dtypes and shapes). Other
    operators run as they are, below the mode: their inner ops are not checked, and the run lists
    them as uncovered (``uncovered``: the tracer's map of op name to modules)."""
    name = str(func._name)  # name() is untyped in torch
    if name == "cond" and len(args) == 4 and not kwargs:
        _pred, true_fn, false_fn, operands = args
        with mode:
            out = true_fn(*operands)
            false_fn(*operands)
        return out
    uncovered = getattr(getattr(mode, "trace", None), "uncovered", None)
    if isinstance(uncovered, dict):
        uncovered.setdefault(f"higher_order.{name}", set()).add("")
    return func(*args, **kwargs)


__all__ = ["is_hop", "run_hop"]
