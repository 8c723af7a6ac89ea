"""What the audit's rules read: one refused op as a :class:`Ctx`, a run as a :class:`Session`.

``make_ctx`` turns an event (a contract violation, or an op that raised) into the context every
rule check sees: the op, its operands' dtypes and provenance, and which operands are at fault.
Which operand is "at fault" is decided once, here, so every rule blames the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from castwise._dtypes import short_of
from castwise.devices import Device
from castwise.rules.audit._base import Diag
from castwise.rules.audit._text import is_ancestor, where
from castwise.trace.events import Mode, Origin, Producer, Prov

if TYPE_CHECKING:
    from castwise.policy import ModuleRule, Policy
    from castwise.report import Finding
    from castwise.trace.events import Trace

LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Ctx:
    """One refused op, as the rules see it."""

    phase: str
    module: str
    op: str | None
    kind: str | None  # the contract's violation kind, or "unsupported" / None for raised errors
    text: str  # the real (or predicted) error message
    dtypes: tuple[torch.dtype, ...]
    provs: tuple[Prov | None, ...]
    culprits: list[int]
    is_fast: bool
    autocast: torch.dtype | None
    compute: torch.dtype
    expected: str | None
    device: Device
    dominant: torch.dtype | None
    unsupported: torch.dtype | None
    stray: bool  # the culprit is a tensor the policy left off its dtype (CW122)
    culprit_provs: list[Prov]
    disabled_by: str | None = None  # the module whose forward turned autocast off around the op
    region_module: Any = None  # that module (the run's copy), for its source

    def make_origin(self, module: str | None, op: str | None, tensor: str | None) -> Origin:
        """An Origin value (rule modules build one through this, without importing the trace layer)."""
        return Origin(module, op, tensor)

    @property
    def source(self) -> str | None:
        """The user's line where the culprit's dtype was made, when recorded."""
        first = self.first
        return first.source if first is not None else None

    @property
    def first(self) -> Prov | None:
        return self.culprit_provs[0] if self.culprit_provs else None

    @property
    def origin(self) -> Origin | None:
        first = self.first
        return first.origin() if first else None

    @property
    def got(self) -> str:
        return ", ".join(sorted({short_of(self.dtypes[i]) for i in self.culprits if i < len(self.dtypes)}))

    @property
    def at(self) -> str:
        return where(self.module) + (f" ({self.op})" if self.op else "")

    @property
    def comp(self) -> str:
        return short_of(self.compute)

    @property
    def modules(self) -> tuple[str, ...]:
        # a shared Parameter's other holders too: a cast through any of them changed it; and for a
        # type promotion (f16 + bf16 -> f32), where the operand off the compute dtype came from
        off = [q.module for p in self.culprit_provs for q in p.promoted if q.dtype != self.compute]
        return tuple(dict.fromkeys(m for p in self.culprit_provs for m in (p.module, *p.shared) if m)) + tuple(
            m for m in dict.fromkeys(off) if m and all(m != p.module for p in self.culprit_provs)
        )

    def diag(
        self,
        code: str,
        message: str,
        fix: str,
        origin: Origin | bool | None = True,
        modules: tuple[str, ...] | None = None,
        source: str | bool | None = True,
        code_fix: tuple[str, int, str, str | None] | None = None,
    ) -> Diag:
        """A diagnosis at this op; ``origin=True``: the culprit's origin (and its source line)."""
        org = self.origin if origin is True else origin if isinstance(origin, Origin) else None
        line = self.source if source is True else source if isinstance(source, str) else None
        return Diag(
            code,
            self.module,
            self.op,
            org,
            message,
            fix,
            self.modules if modules is None else modules,
            self.expected,
            line,
            code_fix,
        )


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
    # (module, tensor, kind, dtype, expected dtype): tensors the policy left off its dtype
    unexpected: list[tuple[str, str, str, torch.dtype, torch.dtype]] = field(default_factory=list)
    unmatched: list[tuple[str, str]] = field(default_factory=list)  # (policy rule, suggestion)

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


@dataclass(frozen=True)
class Session:
    """What run-level rules scan: every run, the policy, and the findings of the event checks."""

    runs: list[RunRecord]
    policy: Policy | None
    findings: list[Finding]

    def finding(self, **fields: Any) -> Finding:
        """A report Finding (rule modules build findings through this, without importing report)."""
        from castwise.report import Finding

        return Finding(**fields)

    def origin(self, module: str | None, op: str | None, tensor: str | None) -> Origin:
        return Origin(module, op, tensor)


@dataclass
class FixContext:
    """Handed to a rule's ``policy_fix``: the compute dtype and a collector for module rules."""

    compute: torch.dtype
    rules: list[ModuleRule] = field(default_factory=list)
    existing: tuple[Any, ...] = ()

    def add(self, selector: str, dtype: torch.dtype, kind: str) -> None:
        from castwise.policy import ModuleRule

        if not selector or selector in ("*",):
            return
        rule = ModuleRule(selector, dtype, kind)  # type: ignore[arg-type]
        if rule not in self.existing and rule not in self.rules:
            self.rules.append(rule)

    def culprits(self, finding: Finding) -> list[str]:
        details = dict(finding.details)
        found = list(details.get("culprit_modules", []))
        if not found and finding.origin is not None and finding.origin.module:
            found = [finding.origin.module]
        return found
