"""What the audit's rules read (the types live in ``castwise.rules.api``, below the engine).

``make_ctx`` turns an event (a contract violation, or an op that raised) into the context every
rule check sees: the op, its operands' dtypes and provenance, and which operands are at fault.
Which operand is "at fault" is decided once, here, so every rule blames the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from castwise.devices import Device
from castwise.rules.api import Ctx, FixContext, Session
from castwise.rules.audit._text import is_ancestor
from castwise.trace.events import Mode, Producer, Prov

if TYPE_CHECKING:
    from castwise.trace.events import Trace

__all__ = ["Ctx", "FixContext", "RunRecord", "Session", "culprits_of", "make_ctx"]


def _own(p: Prov, module: str) -> bool:
    return p.kind in ("param", "buffer") and is_ancestor(p.module, module)


def culprits_of(
    dtypes: tuple[torch.dtype, ...],
    given: tuple[int, ...],
    compute: torch.dtype,
    own: dict[str, torch.dtype] | None = None,
) -> list[int]:
    """Which operands are at fault: the table's answer, else those off the expected dtype."""
    if given:
        return list(given)
    floats = [i for i, d in enumerate(dtypes) if d.is_floating_point]
    if own:
        want = next(iter(own.values()))
        odd = [i for i in floats if dtypes[i] != want]
        if odd:
            return odd
    odd = [i for i in floats if dtypes[i] != compute]
    if odd and len(odd) < len(floats):
        return odd
    if len({dtypes[i] for i in floats}) > 1:
        counts: dict[torch.dtype, int] = {}
        for i in floats:
            counts[dtypes[i]] = counts.get(dtypes[i], 0) + 1
        rare = min(counts, key=lambda d: counts[d])
        return [i for i in floats if dtypes[i] == rare]
    return floats


def _blame(
    module: str,
    dtypes: tuple[torch.dtype, ...],
    provs: tuple[Prov | None, ...],
    culprits: list[int],
    compute: torch.dtype,
    stray: bool,
    autocast: torch.dtype | None = None,
) -> tuple[list[int], list[Prov]]:
    """The culprits' provenance; when the table blames this module's own weights, the operand that
    differs from them instead, unless the weights are the odd ones: off the dtypes the run makes
    there (the compute dtype, and autocast's where it is on), the others in them."""
    culprit_provs = [p for p in (provs[i] for i in culprits if i < len(provs)) if p is not None]
    causes = [p for p in culprit_provs if not _own(p, module)]
    if culprit_provs and not causes and not stray:
        wrong = culprit_provs[0].dtype
        others = [
            p
            for i, p in enumerate(provs)
            if p is not None
            and i < len(dtypes)
            and dtypes[i].is_floating_point
            and dtypes[i] != wrong
            and not _own(p, module)
            # autocast's dtype is the run's, not a cause (in an op autocast leaves alone the
            # module's own f32 tensor is what meets it: a buffer, as a mixed policy keeps it)
            and not (autocast is not None and p.kind == "autocast")
        ]
        # under autocast its dtype is what the policy makes: a bf16 activation meeting an f64
        # weight autocast leaves alone (it casts f32 only) is the run's, the weight the user's
        usual = _usual(compute, autocast)
        if others and not (wrong not in usual and all(p.dtype in usual for p in others)):
            causes = others
            culprits = [i for i, p in enumerate(provs) if p is not None and p in causes]
    return culprits, causes or culprit_provs


def _usual(compute: torch.dtype, autocast: torch.dtype | None) -> set[torch.dtype]:
    """The dtypes the run itself makes: the compute dtype, and under autocast also autocast's and
    the f32 it casts from (a mixed policy's weights are stored f32)."""
    return {compute} if autocast is None else {compute, autocast, torch.float32}


def _not_autocasts(
    culprits: list[int], floats: list[int], dtypes: tuple[torch.dtype, ...], provs: tuple[Prov | None, ...]
) -> list[int]:
    """Under autocast, where every dtype is one the run makes and the table blames operands whose
    dtype autocast chose: the operands of another dtype autocast did not make instead (a model's
    f32 buffer meeting a bf16 activation in an op autocast leaves alone: autocast's is the run's)."""
    if not all(i < len(provs) and (p := provs[i]) is not None and p.kind == "autocast" for i in culprits):
        return culprits
    made = {dtypes[i] for i in culprits}
    other = [i for i in floats if (p := provs[i]) is not None and p.kind != "autocast" and dtypes[i] not in made]
    return other or culprits


def make_ctx(
    *,
    phase: str,
    module: str,
    op: str | None,
    kind: str | None,
    text: str,
    dtypes: tuple[torch.dtype, ...],
    provs: tuple[Prov | None, ...],
    culprits: list[int],
    is_fast: bool,
    autocast: torch.dtype | None,
    compute: torch.dtype,
    expected: str | None,
    device: Device,
    dominant: torch.dtype | None = None,
    unsupported: torch.dtype | None = None,
    off_policy: frozenset[str] = frozenset(),
    disabled_by: str | None = None,
    region_module: Any = None,
    converted: bool = False,
) -> Ctx:
    floats = [i for i in range(min(len(dtypes), len(provs))) if dtypes[i].is_floating_point]
    stray = [
        i
        for i in floats
        if (p := provs[i]) is not None and p.tensor in off_policy and any(dtypes[j] != dtypes[i] for j in floats)
    ]
    if stray:
        # a tensor the policy left off its dtype (CW122) is the odd one wherever it meets others
        culprits = stray
    # the model's own dtype is the norm, and under autocast autocast's too: where the table blames
    # an operand in them, the operand off them is the odd one (an f64 weight autocast leaves alone
    # meets its bf16 activation: the weight is what the user changed)
    usual = _usual(compute, autocast)
    if not stray and culprits and all(dtypes[i] in usual for i in culprits if i < len(dtypes)):
        odd = [i for i in floats if dtypes[i] not in usual]
        if odd:
            culprits = odd
        elif autocast is not None and not is_fast:  # a fused kernel blames its activation itself
            culprits = _not_autocasts(culprits, floats, dtypes, provs)
    culprits, culprit_provs = _blame(module, dtypes, provs, culprits, compute, bool(stray), autocast)
    return Ctx(
        phase,
        module,
        op,
        kind,
        text,
        dtypes,
        provs,
        culprits,
        is_fast,
        autocast,
        compute,
        expected,
        device,
        dominant,
        unsupported,
        bool(stray),
        culprit_provs,
        disabled_by,
        region_module,
        converted,
    )


@dataclass
class RunRecord:
    """One run of the model (a mode, eager or compiled: ``trace.kind``) and what the audit knows
    about the copy it ran."""

    mode: Mode
    trace: Trace
    compute: torch.dtype
    param_dtypes: dict[str, int] = field(default_factory=dict)
    casts: list[tuple[str, str, torch.dtype, torch.dtype]] = field(default_factory=list)
    module_params: dict[str, dict[str, torch.dtype]] = field(default_factory=dict)
    # what made the record (the dispatch-mode tracer, or the compiled-graph producer); rules read
    # the trace, and only the raise triage asks the producer about tensors around a raise
    producer: Producer | None = None
    copy: Any = None  # the model copy the run used (fake tensors hold no memory)
    fake: bool = True
    device: Device | None = None
    dominant: torch.dtype = torch.float32  # the copy's most common parameter dtype, as it ran
    converted: bool = False  # the policy's converted=on: the model's tensors as a framework left them
    # (module, tensor, kind, dtype, expected dtype): tensors the policy left off its dtype
    unexpected: list[tuple[str, str, str, torch.dtype, torch.dtype]] = field(default_factory=list)
    # modules a user's keep[...]/out[...] clause puts in a 16-bit dtype on purpose (keep: with
    # everything inside): precision declared there, not by a whole-model preset
    declared: frozenset[str] = frozenset()

    def submodule(self, name: str | None) -> Any:
        """The run's copy of module ``name`` (None when unknown)."""
        if name is None or self.copy is None:
            return None
        try:
            return self.copy.get_submodule(name) if name else self.copy
        except AttributeError:
            return None

    def off_policy(self) -> frozenset[str]:
        """The provenance names of the tensors the policy left off its dtype (as the tracer names them)."""
        return frozenset(f"{kind} {m + '.' if m else ''}{n}" for m, n, kind, _d, _w in self.unexpected)
