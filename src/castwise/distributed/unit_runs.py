"""Which FSDP unit's forward is running, in the distributed audit's view (audit.py).

FSDP gathers a unit's parameters in the unit's pre-forward hook and, by default, frees them again
after its forward (FSDP1's FULL_SHARD, FSDP2's ``reshard_after_forward=True``; the root keeps
them). A module the unit owns that another module calls outside the unit's forward therefore
meets the shards in the real run (FSDP1: flat f32 views; FSDP2: DTensors) and fails, while the
unsharded model runs. The view gathers every parameter, so the audit watches the calls instead:
each module a non-root unit owns gets a forward pre-hook that reports a call made, during the
forward pass, while its unit's forward is not running and its parameters are not gathered (the
unit has not run yet in this pass, or it reshards after forward). Backward (checkpoint's
recomputation) is left alone: FSDP gathers there in its pre-backward hook.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from castwise.report import Finding, Origin
from castwise.rules.audit._text import module_expr

if TYPE_CHECKING:
    from torch import nn

    from castwise.distributed.plan import UnitPlan


@dataclass
class Seen:
    """What the runs of one view record, shared by every copy a run makes of it (the forwards and
    hooks hold it in closures, which a deepcopy shares): unit -> the dtypes it computed in, and
    (module, unit) -> the modes it was called in outside its unit's forward."""

    computed: dict[str, Counter[torch.dtype]] = field(default_factory=dict)
    outside: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    # (unit, input) -> (dtype, shape, cast to) of a position table its input cast narrowed (CW172)
    narrowed: dict[tuple[str, str], tuple[str, tuple[int, ...], str]] = field(default_factory=dict)


class _Pass:
    """Whether the outermost unit's forward (a forward pass) is running."""

    def __init__(self) -> None:
        self.open = False


class _UnitRun:
    """A unit's state in one forward pass: shared by the unit's module and every module it owns,
    in the view and in each copy a run makes of it (a deepcopy keeps the sharing)."""

    def __init__(self, name: str, reshards: bool, pass_: _Pass) -> None:
        self.name = name
        self.reshards = reshards
        self.pass_ = pass_
        self.entered = False
        self.active = 0


def unit_of(name: str, units: list[str]) -> str:
    """The innermost of ``units`` that holds the module ``name`` ("" is the root)."""
    best = ""
    for u in units:
        if (not u or name == u or name.startswith(u + ".")) and len(u) >= len(best):
            best = u
    return best


def watch(view: nn.Module, records: list[UnitPlan], reshards: dict[str, bool | None], seen: Seen | None) -> None:
    """Every module a non-root unit owns (not those of units inside it) gets ``_check``.
    ``reshards``: a unit that keeps its parameters gathered after forward maps to False; one never
    sharded (FSDP1's NO_SHARD) to None, and is not watched; a unit not in it reshards."""
    if not records or seen is None:
        return
    names = [u.name for u in records if u.name and u.params]
    pass_ = _Pass()
    states = []
    for unit in names:
        after = reshards.get(unit, True)
        if after is None:
            continue
        state = _UnitRun(unit, after, pass_)
        states.append(state)
        view.get_submodule(unit).__dict__["_castwise_unit"] = state
        for name, module in view.get_submodule(unit).named_modules(prefix=unit):
            if name != unit and unit_of(name, names) == unit:  # not those of a unit inside
                module.__dict__["_castwise_unit"] = state
                module.__dict__["_castwise_name"] = name
                module.register_forward_pre_hook(lambda m, args: _check(m, seen.outside))
    outer = records[-1].name  # innermost first: the root is last
    (view.get_submodule(outer) if outer else view).__dict__["_castwise_units"] = (pass_, states)


@contextlib.contextmanager
def unit_call(module: nn.Module) -> Iterator[None]:
    """Around a unit's forward in the view: the outermost unit opens a pass."""
    outer = module.__dict__.get("_castwise_units")
    run = module.__dict__.get("_castwise_unit")
    pass_, states = outer if isinstance(outer, tuple) else (None, ())
    opened = isinstance(pass_, _Pass) and not pass_.open
    if isinstance(pass_, _Pass) and opened:
        for state in states:
            state.entered = False
        pass_.open = True
    if isinstance(run, _UnitRun):
        run.entered = True
        run.active += 1
    try:
        yield
    finally:
        if isinstance(run, _UnitRun):
            run.active -= 1
        if isinstance(pass_, _Pass) and opened:
            pass_.open = False


def _check(module: nn.Module, seen: dict[tuple[str, str], set[str]]) -> None:
    unit = module.__dict__.get("_castwise_unit")
    if not isinstance(unit, _UnitRun) or not unit.pass_.open or unit.active:
        return
    if unit.entered and not unit.reshards:
        return  # gathered by its forward earlier in this pass, and kept
    name = str(module.__dict__.get("_castwise_name", "?"))
    seen.setdefault((name, unit.name), set()).add("train" if module.training else "eval")


def outside_findings(seen: dict[tuple[str, str], set[str]]) -> list[Finding]:
    """A CW126 error for each outermost module called outside its unit's forward."""
    found: list[Finding] = []
    flagged = [name for name, _unit in seen]
    for (name, unit), modes in seen.items():
        if any(name.startswith(other + ".") for other in flagged):
            continue  # inside a module already reported
        found.append(
            Finding(
                code="CW126",
                message=(
                    f"`{name}` runs outside the forward of its FSDP unit `{unit}`: another module calls it "
                    f"directly. FSDP gathers `{unit}`'s parameters in that unit's pre-forward and frees them "
                    f"after its forward, so here `{name}` meets their shards (FSDP1: flat f32 views; FSDP2: "
                    "DTensors) and the real run fails; the unsharded model runs."
                ),
                module=name,
                origin=Origin(unit, None, f"FSDP unit {unit}"),
                modes=tuple(m for m in ("train", "eval") if m in modes),  # type: ignore[misc]
                fix=(
                    f"Make `{name}` a unit of its own, so that its own pre-forward gathers it: "
                    f"fully_shard({module_expr(name)}) before `{unit}` is sharded (FSDP1: wrap it in its own "
                    "FullyShardedDataParallel, or add its class to the auto-wrap policy)."
                ),
            )
        )
    return found


__all__ = ["Seen", "outside_findings", "unit_call", "unit_of", "watch"]
