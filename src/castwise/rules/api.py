"""What audit rules read and return, below the engine (torch-free at import).

A rule check reads one refused op as a :class:`Ctx` and returns a :class:`Diag`; a scan reads
every run as a :class:`Session` and returns :class:`Finding` values; a policy fix collects module
rules in a :class:`FixContext`. The plain values rules build or read (``Origin``, ``HookChange``,
``Finding``) live here; the engine's own records (the trace's ``Prov``, ``Upcast``, ``Trace``, the
audit's runs, the ``Policy``) satisfy the ``...Like`` protocols by their shape. So nothing under
``rules/`` imports the layers above it (as ruff's diagnostics sit below its checker and rules).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from castwise._dtypes import short_of
from castwise.rules._rule import Rule, Severity, get
from castwise.rules.audit._text import where

if TYPE_CHECKING:
    import torch

    from castwise.devices import Device

Mode = Literal["train", "eval"]


@dataclass(frozen=True)
class Origin:
    """Where an offending dtype came from: a module, an op in it, or a named tensor."""

    module: str | None = None
    op: str | None = None
    tensor: str | None = None  # e.g. "param encoder.0.weight", "input x", "bf16[2, 4]"

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "op": self.op, "tensor": self.tensor}

    def __str__(self) -> str:
        parts = [p for p in (self.tensor, self.op and f"op {self.op}") if p]
        where = f"`{self.module}`" if self.module else "(model input)" if self.module == "" else ""
        return " ".join(p for p in (where, *parts) if p) or "(unknown)"


class ProvLike(Protocol):  # where a tensor's dtype came from (trace.events.Prov)
    @property
    def kind(self) -> str: ...
    @property
    def module(self) -> str: ...
    @property
    def op(self) -> str | None: ...
    @property
    def tensor(self) -> str | None: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def source(self) -> str | None: ...
    @property
    def shared(self) -> Sequence[str]: ...
    @property
    def promoted(self) -> Sequence[ProvLike]: ...
    def origin(self) -> Origin: ...
    def describe(self) -> str: ...


@dataclass(frozen=True)
class HookChange:
    """A user hook returned a tensor in another dtype than it was given."""

    kind: Literal["grad", "forward"]  # a parameter's gradient hook, or a module's forward hook
    module: str  # the module owning the hooked parameter, or the hooked module
    tensor: str | None  # "param lm_head.weight" for gradient hooks
    hook: str  # the hook's qualified name
    before: torch.dtype
    after: torch.dtype
    source: str | None  # where the hook is defined ("train.py:12")
    # the code fix: (file, line, new line, old line) of the hook's return with the cast back
    code_fix: tuple[str, int, str, str | None] | None = None


class EventLike(Protocol):
    @property
    def module(self) -> str: ...
    @property
    def op(self) -> str: ...
    @property
    def phase(self) -> str: ...


class UpcastLike(Protocol):
    @property
    def module(self) -> str: ...
    @property
    def in_dtype(self) -> torch.dtype: ...
    @property
    def prov(self) -> ProvLike | None: ...


class TraceLike(Protocol):  # what scans read of one run's record (trace.events.Trace)
    @property
    def events(self) -> Sequence[EventLike]: ...
    @property
    def failure(self) -> EventLike | None: ...
    @property
    def upcasts(self) -> Sequence[UpcastLike]: ...
    @property
    def uncovered(self) -> Mapping[str, AbstractSet[str]]: ...
    @property
    def observed(self) -> Mapping[str, Any]: ...  # what observers recorded, by name ("mixed_width")
    @property
    def activation_bytes(self) -> Mapping[str, int]: ...
    @property
    def branches(self) -> Mapping[tuple[str, int], dict[str, Any]]: ...  # data-dependent branch sites
    @property
    def sizes(self) -> Sequence[dict[str, Any]]: ...  # data-dependent sizes assumed


class RunLike(Protocol):  # one run of the model and the copy it ran (auditor.context.RunRecord)
    @property
    def mode(self) -> Mode: ...
    @property
    def trace(self) -> TraceLike: ...
    @property
    def copy(self) -> Any: ...
    @property
    def device(self) -> Device | None: ...  # the simulated target
    # (module, tensor, kind, dtype, expected dtype): tensors the policy left off its dtype
    @property
    def unexpected(self) -> Sequence[tuple[str, str, str, torch.dtype, torch.dtype]]: ...
    # modules a user's keep[...]/out[...] clause puts in 16-bit on purpose (inside a keep too)
    @property
    def declared(self) -> frozenset[str]: ...
    # (module, tensor, dtype before, dtype after): what applying the policy cast
    @property
    def casts(self) -> Sequence[tuple[str, str, torch.dtype, torch.dtype]]: ...


class PolicyLike(Protocol):
    @property
    def is_mixed(self) -> bool: ...
    @property
    def loss_scale(self) -> Any: ...
    @property
    def master_weights(self) -> bool: ...


@dataclass(frozen=True)
class Diag:
    """A diagnosis before it becomes a Finding (findings of several modes and places merge)."""

    code: str
    module: str
    op: str | None
    origin: Origin | None
    message: str
    fix: str
    culprit_modules: tuple[str, ...] = ()
    expected: str | None = None
    source: str | None = None  # the user's line where the origin was made ("file.py:42")
    # (file, line, replacement line, original line): the code change where no policy fixes it
    code_fix: tuple[str, int, str, str | None] | None = None
    details: tuple[tuple[str, Any], ...] = ()  # extra JSON fields of the finding (e.g. the hook)
    compiled_only: bool = False  # about torch.compile's run alone (JSON "run": "compiled")


SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class CodeFix:
    """A one-line code change: in ``file`` at ``line``, the line becomes ``replace``.

    ``verified``: a re-audit with the change simulated (the hook's result cast back, ...) found
    no error; False: not simulated, or the re-audit still found one."""

    file: str
    line: int
    replace: str
    original: str | None = None
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "replace": self.replace,
            "original": self.original,
            "verified": self.verified,
        }

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.replace.strip()}"


@dataclass(frozen=True)
class Finding:
    code: str
    message: str
    module: str | None = None
    op: str | None = None
    origin: Origin | None = None
    modes: tuple[Mode, ...] = ()
    fix: str | None = None
    severity: Severity | None = None  # None: the rule's default (resolved at construction)
    settings: tuple[str, ...] = ()  # lint-config: settings exactly as written
    locations: tuple[str, ...] = ()  # lint-config: "file:line" of each setting
    details: tuple[tuple[str, Any], ...] = ()  # extra JSON fields, e.g. dtypes seen
    source: str | None = None  # "models/rope.py:42": the user's line where the origin was made
    code_fix: CodeFix | None = None  # the code change, where no policy can express the fix
    # about torch.compile's run alone (it stopped): not the eager run's status (JSON "run": "compiled")
    compiled_only: bool = False

    def __post_init__(self) -> None:
        rule = get(self.code)  # an unknown code is a bug in castwise: fail here, not at render
        if self.severity is None:
            object.__setattr__(self, "severity", rule.severity)
        elif self.severity not in SEVERITY_ORDER:
            raise ValueError(f"severity {self.severity!r} is not valid; valid: {', '.join(sorted(SEVERITY_ORDER))}")

    @property
    def rule(self) -> Rule:
        return get(self.code)

    @property
    def level(self) -> str:
        """The severity (same as ``severity``, which is never None after construction)."""
        return self.severity or self.rule.severity

    def to_dict(self) -> dict[str, Any]:
        rule = self.rule
        out: dict[str, Any] = {
            "code": self.code,
            "name": rule.name,
            "category": rule.category,
            "severity": self.level,
            "module": self.module,
            "op": self.op,
            "origin": self.origin.to_dict() if self.origin else None,
            "modes": list(self.modes),
            "message": self.message,
            "fix": self.fix or rule.fix,
            "source": self.source,
            "code_fix": self.code_fix.to_dict() if self.code_fix else None,
        }
        if self.settings:
            out["settings"] = list(self.settings)
        if self.locations:
            out["locations"] = list(self.locations)
        if self.compiled_only:
            out["run"] = "compiled"
        out.update(dict(self.details))
        return out


@dataclass(frozen=True)
class Ctx:
    """One refused op, as the rules see it."""

    phase: str
    module: str
    op: str | None
    kind: str | None  # the contract's violation kind, or "unsupported" / None for raised errors
    text: str  # the real (or predicted) error message
    dtypes: tuple[torch.dtype, ...]
    provs: tuple[ProvLike | None, ...]
    culprits: list[int]
    is_fast: bool
    autocast: torch.dtype | None
    compute: torch.dtype
    expected: str | None
    device: Device
    dominant: torch.dtype | None
    unsupported: torch.dtype | None
    stray: bool  # the culprit is a tensor the policy left off its dtype (CW122)
    culprit_provs: Sequence[ProvLike]
    disabled_by: str | None = None  # the module whose forward turned autocast off around the op
    region_module: Any = None  # that module (the run's copy), for its source
    converted: bool = False  # the policy models a framework that converted the model already (converted=on)

    @property
    def source(self) -> str | None:
        """The user's line where the culprit's dtype was made, when recorded."""
        first = self.first
        return first.source if first is not None else None

    @property
    def first(self) -> ProvLike | None:
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


@dataclass(frozen=True)
class Session:
    """What run-level rules scan: every run, the policy, and the findings of the event checks."""

    runs: Sequence[RunLike]
    policy: PolicyLike | None
    findings: list[Finding]


# a module rule a policy fix adds: (selector, dtype, kind), made the policy's own rule by the audit
Pin = tuple[str, "torch.dtype", Literal["keep", "out"]]


@dataclass
class FixContext:
    """Handed to a rule's ``policy_fix``: the compute dtype and a collector for module rules."""

    compute: torch.dtype
    rules: list[Pin] = field(default_factory=list)
    existing: tuple[object, ...] = ()  # the policy's rules already, as pins

    def add(self, selector: str, dtype: torch.dtype, kind: Literal["keep", "out"]) -> None:
        rule = (selector, dtype, kind)
        if selector and selector != "*" and rule not in self.existing and rule not in self.rules:
            self.rules.append(rule)

    def culprits(self, finding: Finding) -> list[str]:
        found = list(dict(finding.details).get("culprit_modules", []))
        if not found and finding.origin is not None and finding.origin.module:
            found = [finding.origin.module]
        return found
