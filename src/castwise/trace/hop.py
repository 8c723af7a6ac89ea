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
        _pred, true_fn, false_fn, operands = args
        with mode:
            out = true_fn(*operands)
            false_fn(*operands)
        return out
    recorder.uncovered(f"higher_order.{name}", "")
    return func(*args, **kwargs)


@contextlib.contextmanager
def dynamo_skips_restored() -> Iterator[None]:
    """Dynamo's frames met in a run left as they were before it. A ``torch.compile`` inside the
    model (eager ``torch.cond``'s wrapper, ``flex_attention``'s) meets the tracer's dispatch mode,
    and Dynamo skips that frame; torch 2.10 (and 2.12 for cond) marks its code skipped for good
    (torch/_dynamo/convert_frame.py, ``CatchErrorsWrapper.__call__``: ``ConvertFrameReturn()``, whose
    strategy applies to the code), so every later real call in the process runs the wrapper
    uncompiled under Dynamo and fails (2.10's flex_attention: "marked as skipped" in its dense
    implementation). Dynamo's frame callback notes each code it meets (``input_codes.add``), and a
    code it meets had no skip mark (a marked one never reaches it); after the run each such code
    gets the default strategy back (its compiled entries stay)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    met: list[types.CodeType] = []
    tracker = getattr(convert_frame, "input_codes", None)
    add = getattr(tracker, "add", None)
    outer = vars(tracker).get("add") if tracker is not None else None  # a run's inside another's
    if tracker is not None and add is not None:

        def noting(code: types.CodeType) -> None:
            met.append(code)
            add(code)

        tracker.add = noting
    try:
        yield
    finally:
        if tracker is not None:
            if outer is not None:
                tracker.add = outer
            else:
                vars(tracker).pop("add", None)  # the class's method again
        else:
            # Dynamo was imported during the run: every code it met is the run's
            tracker = getattr(sys.modules.get("torch._dynamo.convert_frame"), "input_codes", None)
            met = [c for c in (ref() for ref in getattr(tracker, "seen", ())) if c is not None]
        if met:
            _unskip(met)


def _unskip(codes: list[types.CodeType]) -> None:
    from torch._C._dynamo import eval_frame

    default = eval_frame._FrameExecStrategy(eval_frame._FrameAction.DEFAULT, eval_frame._FrameAction.DEFAULT)
    for code in set(codes):
        eval_frame.set_code_exec_strategy(code, default)


__all__ = ["dynamo_skips_restored", "is_hop", "run_hop"]
