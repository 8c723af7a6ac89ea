"""Which FSDP2 units a model gets under a castwise policy, and what each one does.

A *unit* is a module that ``torch.distributed.fsdp.fully_shard`` is called on: its parameters
(minus those of units inside it) are sharded together, all-gathered together before its forward
and reduce-scattered together after its backward, under one ``MixedPrecisionPolicy``. So a unit
has exactly one gather dtype: an fp32 island that is not its own unit is gathered in the
enclosing unit's bf16, whatever a cast at its boundary does later. Hence castwise's layout,
innermost first (``fully_shard`` must see inner units before outer ones):

1. every island of the policy (``keep[...]``, norms, ``_keep_in_fp32_modules``) that owns
   parameters: stored, gathered and computed in its dtype, inputs cast in, output cast back;
2. the model's repeated blocks (transformers' ``_no_split_modules`` classes, else the items of
   a ``ModuleList``/``Sequential`` of one class), as the ecosystem's FSDP2 recipes wrap them;
3. the root, which holds the rest (embeddings, head) and casts the model's inputs and outputs.

Blocks and the root store parameters in the policy's ``params`` dtype and gather them in its
``compute`` dtype: under FSDP2 the gather *is* the mixed precision, so no autocast is entered
(an island stays f32 because its own unit gathers it in f32). Gradients are reduced in the
policy's ``reduce`` dtype (an f32 island never in less than f32). FSDP2 neither shards nor casts
buffers: castwise casts them as ``castwise.apply`` does (islands' buffers to the island dtype;
every buffer under a true policy or a ``buffers=`` clause).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from castwise._dtypes import short_of
from castwise.applied.inspection import resolve
from castwise.errors import ShardError as ShardError
from castwise.policy import ModuleRule, Policy

if TYPE_CHECKING:
    from torch import nn

UnitKind = Literal["island", "block", "unit", "root"]
_WIDTH = {torch.float64: 64, torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}


def _short(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else short_of(dtype)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


@dataclass(frozen=True)
class UnitPlan:
    """What one FSDP2 unit does: the dtypes its parameters are stored (sharded), gathered,
    computed and reduced in, what its output is cast to and what its inputs are cast to."""

    name: str  # named_modules() name; "" is the root
    kind: UnitKind
    params: int  # elements of the parameters this unit owns (not those of units inside it)
    stored: torch.dtype | None  # the sharded parameters' dtype (None: the unit owns none)
    gather: torch.dtype  # all-gathered in (FSDP2 MixedPrecisionPolicy.param_dtype)
    compute: torch.dtype  # its own ops run in
    reduce: torch.dtype  # gradients reduce-scattered in (MixedPrecisionPolicy.reduce_dtype)
    output: torch.dtype | None  # floating outputs cast to (None: left as computed)
    inputs: torch.dtype | None  # floating inputs cast to on entry (None: left as they come)
    reason: str = ""  # why it is a unit: "repeated block LlamaDecoderLayer", "island: norms", ...
    saturate: bool = False  # f32 island returning to f16: clamp to f16's range before the cast

    @property
    def label(self) -> str:
        return self.name or "(root)"

    def mp_policy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``torch.distributed.fsdp.MixedPrecisionPolicy`` for this unit."""
        return {
            "param_dtype": self.gather,
            "reduce_dtype": self.reduce,
            "output_dtype": self.output,
            "cast_forward_inputs": self.inputs is not None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.label,
            "kind": self.kind,
            "params": self.params,
            "stored": None if self.stored is None else _short(self.stored),
            "gather": _short(self.gather),
            "compute": _short(self.compute),
            "reduce": _short(self.reduce),
            "output": None if self.output is None else _short(self.output),
            "inputs": None if self.inputs is None else _short(self.inputs),
            "reason": self.reason,
        }

    def __str__(self) -> str:
        return (
            f"{self.label}: {self.kind}, {_count(self.params)} params stored {_short(self.stored)}, "
            f"gathered {_short(self.gather)}, computes {_short(self.compute)}, reduces {_short(self.reduce)}"
            + (f", output cast to {_short(self.output)}" if self.output is not None else "")
            + (f", inputs cast to {_short(self.inputs)}" if self.inputs is not None else "")
        )


@dataclass(frozen=True)
class BufferCast:
    name: str
    before: torch.dtype
    after: torch.dtype

    def __str__(self) -> str:
        return f"{self.name} {_short(self.before)} -> {_short(self.after)}"


@dataclass(frozen=True, repr=False)
class Plan:
    """Every unit of a model under a policy, innermost first (the order ``fully_shard`` needs),
    the root last; plus what castwise does that FSDP2 does not (buffers, output rules)."""

    model: str  # the model's class name
    policy: Policy
    units: tuple[UnitPlan, ...]
    buffers: tuple[BufferCast, ...] = ()
    param_casts: tuple[BufferCast, ...] = ()  # parameters castwise casts before sharding
    output_rules: tuple[tuple[str, torch.dtype], ...] = ()  # out[...] rules: (module, dtype)

    def unit(self, name: str) -> UnitPlan:
        for u in self.units:
            if u.name == name:
                return u
        raise ShardError(f"no unit {name!r} in this plan; valid: {', '.join(sorted(u.label for u in self.units))}")

    def to_dict(self) -> list[dict[str, Any]]:
        return [u.to_dict() for u in self.units]

    def __repr__(self) -> str:
        # `castwise.fsdp2.plan(model, policy)` at a prompt or in a notebook shows the table
        return str(self)

    def __str__(self) -> str:
        p = self.policy
        head = (
            f"castwise.fsdp2 plan for {self.model} under {p}: {len(self.units)} units, innermost first "
            f"(compute {_short(p.compute_dtype)}, reduce {_short(p.reduce_dtype)})"
        )
        cols = ("unit", "kind", "params", "stored", "gather", "compute", "reduce", "output", "inputs")
        rows = [
            (
                u.label,
                u.kind,
                _count(u.params),
                _short(u.stored),
                _short(u.gather),
                _short(u.compute),
                _short(u.reduce),
                _short(u.output),
                _short(u.inputs),
            )
            for u in self.units
        ]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = [head, "  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        if p.is_mixed:
            lines.append(
                f"no autocast: FSDP2 gathers the weights in {_short(p.compute_dtype)}, so ops run in "
                f"{_short(p.compute_dtype)}; f32 master weights stay sharded"
            )
        if self.param_casts:
            lines.append("parameters cast by castwise before sharding: " + _grouped(self.param_casts))
        if self.buffers:
            lines.append("buffers cast by castwise (FSDP2 leaves buffers as they are): " + _grouped(self.buffers))
        if p.loss_scale is not None:
            lines.append(
                f"loss scaling ({p.loss_scale}) is the training loop's: torch.amp.GradScaler works on "
                "FSDP2's DTensor gradients"
            )
        for name, dtype in self.output_rules:
            lines.append(f"output of {name or '(root)'} cast to {_short(dtype)} by castwise (out rule)")
        return "\n".join(lines)


def _grouped(casts: Sequence[BufferCast], shown: int = 3) -> str:
    """``16 f32 -> bf16 (a.weight, b.weight, c.weight, ...)`` per kind of cast."""
    groups: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for c in casts:
        groups.setdefault((c.before, c.after), []).append(c.name)
    parts = []
    for (before, after), names in groups.items():
        more = ", ..." if len(names) > shown else ""
        parts.append(f"{len(names)} {_short(before)} -> {_short(after)} ({', '.join(names[:shown])}{more})")
    return "; ".join(parts)


# -- discovery ------------------------------------------------------------------------------------


def _is_inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def _repeated_blocks(model: nn.Module) -> list[tuple[str, str]]:
    """(name, reason) of the model's repeated blocks, outermost only."""
    from torch import nn

    classes: set[str] = set()
    for module in model.modules():
        keep = getattr(module, "_no_split_modules", None)
        if isinstance(keep, (list, tuple, set)):
            classes |= {str(c) for c in keep}
    found: list[tuple[str, str]] = []
    if classes:
        for name, module in model.named_modules():
            if name and type(module).__name__ in classes and not any(_is_inside(name, f) for f, _ in found):
                found.append((name, f"repeated block {type(module).__name__} (_no_split_modules)"))
        if found:
            return found
    blocks = repeated_children(model, (nn.ModuleList, nn.Sequential))
    return [(name, f"repeated block {type(block).__name__}") for name, block in blocks]


def repeated_children(model: nn.Module, containers: tuple[type[nn.Module], ...]) -> list[tuple[str, nn.Module]]:
    """The children of every container (of ``containers``) holding two or more modules of one
    class with parameters: a model's repeated blocks, outermost containers only (a layer's own
    list of experts stays inside its layer)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, containers) or any(_is_inside(name, f) for f, _ in found):
            continue
        children = list(module.named_children())
        kinds = {type(c) for _, c in children}
        if len(children) >= 2 and len(kinds) == 1 and any(True for _ in children[0][1].parameters()):
            prefix = f"{name}." if name else ""
            found += [(prefix + child, c) for child, c in children]
    return found


def _selected(model: nn.Module, selectors: Sequence[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    named = list(model.named_modules())
    for selector in selectors:
        if not isinstance(selector, str):
            raise ShardError(
                f"units: {selector!r} is not a selector; valid: module names or globs ('model.layers.*'), "
                "'re:REGEX', 'class:Name'"
            )
        rule = ModuleRule(selector, torch.float32)
        hits = [n for n, m in named if n and rule.matches(n, m)]
        if not hits:
            raise ShardError(
                f"units: {selector!r} matches no module of {type(model).__name__}; valid: module names such as "
                f"{', '.join(sorted(n for n, _ in named if n and n.count('.') <= 1)[:6])}, ... or globs like "
                "'model.layers.*' (a '*' is one dotted segment)"
            )
        out += [(n, f"units selector {selector!r}") for n in hits if n not in {o for o, _ in out}]
    return out


def _owned(model: nn.Module, unit: str, units: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of what ``unit`` shards: its own, minus those of units inside it.
    ``named_parameters`` yields a tied weight once, under its first name."""
    inner = [u for u in units if u != unit and _is_inside(u, unit)]
    out: list[tuple[str, torch.Tensor]] = []
    module = model.get_submodule(unit) if unit else model
    prefix = f"{unit}." if unit else ""
    for pname, p in module.named_parameters():
        full = prefix + pname
        if not any(_is_inside(full, u) for u in inner):
            out.append((full, p))
    return out


def _widest(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if _WIDTH.get(a, 0) >= _WIDTH.get(b, 0) else b


def make_plan(model: nn.Module, policy: Policy | str, units: Sequence[str] | None = None) -> Plan:
    """The units of ``model`` under ``policy`` and what each does; nothing is changed.

    ``units``: selectors (module names, globs, ``re:``, ``class:``) of the modules to shard as
    units instead of the repeated blocks; islands and the root are units in any case.
    """
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ShardError(f"castwise.fsdp2 needs a torch.nn.Module, got {type(model).__name__}")
    policy = Policy.parse(policy)
    if isinstance(units, str):
        units = [units]
    decisions = resolve(policy, model)
    islands = {n: d.island for n, d in decisions.items() if d.island is not None and n}
    chosen = _chosen(model, units, islands, {n: d.island_reason for n, d in decisions.items()})
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    names = sorted(chosen, key=lambda n: (-n.count("."), order[n]))  # innermost first, then model order
    all_units = [*names, ""]

    plans: list[UnitPlan] = []
    param_casts: list[BufferCast] = []
    seen: set[int] = set()
    for name in all_units:
        kind, reason = chosen.get(name, ("root", "the root holds every parameter no other unit owns"))
        owned = [(n, p) for n, p in _owned(model, name, all_units) if p.is_floating_point()]
        own = [p for _, p in owned]
        island = islands.get(name) if name else None
        if kind == "island" and island is not None:
            unit, target = _island_unit(name, reason, own, island, islands, policy)
        else:
            unit, target = _unit(name, kind, reason, own, islands, policy)
        plans.append(unit)
        for full, p in owned:
            if target is not None and id(p) not in seen and p.dtype != target:
                seen.add(id(p))
                param_casts.append(BufferCast(full, p.dtype, target))
    buffers = _buffer_casts(model, policy, islands)
    outs = tuple((n, d.output) for n, d in decisions.items() if d.output is not None)
    return Plan(type(model).__name__, policy, tuple(plans), tuple(buffers), tuple(param_casts), outs)


def _chosen(
    model: nn.Module,
    units: Sequence[str] | None,
    islands: dict[str, torch.dtype],
    island_reasons: dict[str, str | None],
) -> dict[str, tuple[UnitKind, str]]:
    """The modules sharded as units (the root aside): blocks or selected units, then the islands."""
    blocks = _selected(model, list(units)) if units is not None else _repeated_blocks(model)
    chosen: dict[str, tuple[UnitKind, str]] = {}
    for name, reason in blocks:
        chosen[name] = ("block" if units is None else "unit", reason)
    for name, dtype in islands.items():
        chosen[name] = ("island", f"island {short_of(dtype)}: {island_reasons[name]}")
    return chosen


def _island_of(islands: dict[str, torch.dtype], name: str) -> torch.dtype | None:
    """The dtype of the innermost island enclosing (or being) module ``name``, if any."""
    parts = name.split(".") if name else []
    for i in range(len(parts), 0, -1):
        d = islands.get(".".join(parts[:i]))
        if d is not None:
            return d
    return None


def _island_unit(
    name: str,
    reason: str,
    own: list[torch.Tensor],
    island: torch.dtype,
    islands: dict[str, torch.dtype],
    policy: Policy,
) -> tuple[UnitPlan, torch.dtype | None]:
    """An island's unit: stored and run in the island's dtype, cast back to its parent's on output."""
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    back = _island_of(islands, parent) or policy.compute_dtype
    unit = UnitPlan(
        name,
        "island",
        sum(p.numel() for p in own),
        island if own else None,
        island,
        island,
        _widest(island, policy.reduce_dtype),
        back if back != island else None,
        island,
        reason,
        saturate=policy.cast_back == "saturate" and back == torch.float16 and island != torch.float16,
    )
    return unit, island


def _unit(
    name: str,
    kind: UnitKind,
    reason: str,
    own: list[torch.Tensor],
    islands: dict[str, torch.dtype],
    policy: Policy,
) -> tuple[UnitPlan, torch.dtype | None]:
    """A block, a selected unit or the root (``name == ""``), and the dtype its parameters are stored in."""
    compute, reduce = policy.compute_dtype, policy.reduce_dtype
    enclosing = _island_of(islands, name) if name else None  # a block inside an island runs in the island's dtype
    target = enclosing or (None if policy.is_mixed else policy.param_dtype)
    dtypes = {p.dtype for p in own}
    stored = target or (max(dtypes, key=lambda d: sum(p.numel() for p in own if p.dtype == d)) if dtypes else None)
    numel = sum(p.numel() for p in own)
    if name:
        runs = enclosing or compute
        reduce_in = _widest(runs, reduce) if enclosing else reduce
        return UnitPlan(name, kind, numel, stored, runs, runs, reduce_in, None, None, reason), target
    inputs = policy.input_dtype or (compute if policy.is_mixed else None)
    output = policy.output_dtype if policy.output_dtype != compute else None
    return UnitPlan("", "root", numel, stored, compute, compute, reduce, output, inputs, reason), target


def _buffer_casts(model: nn.Module, policy: Policy, islands: dict[str, torch.dtype]) -> list[BufferCast]:
    """The floating buffers whose dtype the plan changes: to their island's dtype, else the policy's."""
    buffers: list[BufferCast] = []
    default_buffer = policy.buffer_dtype if policy.is_mixed else policy.effective_buffer_dtype
    for bname, b in model.named_buffers():
        if not b.is_floating_point():
            continue
        owner = bname.rsplit(".", 1)[0] if "." in bname else ""
        target_b = _island_of(islands, owner) or default_buffer
        if target_b is not None and b.dtype != target_b:
            buffers.append(BufferCast(bname, b.dtype, target_b))
    return buffers
