"""``castwise.audit`` of a distributed setup: a model sharded by FSDP2, or a plan for one.

Each FSDP2 unit all-gathers its parameters in its ``MixedPrecisionPolicy.param_dtype``, runs,
casts its output to ``output_dtype`` and reduce-scatters gradients in ``reduce_dtype``; its
inputs are cast to ``param_dtype`` when ``cast_forward_inputs``. What the model computes is
therefore the unsharded model with every parameter in its unit's gather dtype and those casts at
the units' boundaries. The audit builds exactly that, as a *view*: the model's own module
objects' classes and attributes, no FSDP hooks, parameters as meta tensors of their global
shape in the gather dtype (no weight memory, whatever the model's size or world size), and
castwise forwards doing FSDP2's input and output casts. The view is audited by the ordinary
``castwise.audit`` (fake tensors, forward and backward), so a sharded model gets the same
findings as an unsharded one running the same dtypes, plus one record per unit under
``report.to_dict()["units"]``: the dtypes it stores, gathers, computes, reduces and outputs in,
and its parameter bytes per rank.

A model sharded by ``castwise.fsdp2.fully_shard`` carries its plan (islands, blocks, the root's
output dtype); one sharded by torch's ``fully_shard`` is read from its FSDP states; one wrapped by
FSDP1 (``FullyShardedDataParallel``), from its wrappers (fsdp1.py), with the same view.
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from castwise._dtypes import short_of
from castwise.distributed import fsdp1, scale_rules, tp, unit_runs
from castwise.distributed.plan import Plan, UnitPlan, make_plan
from castwise.errors import AuditError
from castwise.policy import Policy
from castwise.report import Finding, Origin, Report
from castwise.run import tensors_of

if TYPE_CHECKING:
    from torch import nn

_BYTES = {torch.float64: 8, torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
_STATE_KEY = "__composable_api_state_key"


def is_sharded(model: Any, *, real: bool = False) -> bool:
    """Whether ``model`` (or a module in it) is sharded by FSDP2 or wrapped by FSDP1. Cheap when
    torch.distributed's FSDP was never imported: nothing can be sharded then. ``real``: a
    real-tensor audit, where a tensor-parallel model alone runs this rank's real DTensors, which
    the plain tracer follows."""
    if not real and tp.has_tp(model):  # tensor / sequence parallel (DTensor parameters), with FSDP2 or without
        return True
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    return fsdp1.is_wrapped(model) or (
        isinstance(model, nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())
    )


# -- reading the FSDP2 states --------------------------------------------------------------------


def _states(model: nn.Module) -> Iterator[tuple[str, Any, Any]]:  # (name, FSDPModule, FSDPState)
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            yield name, module, module._get_fsdp_state()


def _fsdp_params(state: Any) -> list[Any]:
    group = getattr(state, "_fsdp_param_group", None)
    groups = [group] if group is not None else list(getattr(state, "_fsdp_param_groups", None) or [])
    return [fp for g in groups for fp in g.fsdp_params]


def _global_numel(p: torch.Tensor) -> int:
    return int(torch.Size(p.shape).numel())


def records_of(model: nn.Module) -> tuple[list[UnitPlan], dict[int, torch.dtype]]:
    """One record per FSDP2 unit of a sharded model (innermost first, the root last), and the
    dtype each sharded parameter is gathered in (by ``id`` of the registered parameter)."""
    from castwise import fsdp2

    plan = fsdp2.plan_of(model)
    planned = {u.name: u for u in plan.units} if plan is not None else {}
    records: list[UnitPlan] = []
    gather_of: dict[int, torch.dtype] = {}
    states = list(_states(model))  # in named_modules() order
    order = {s[0]: i for i, s in enumerate(states)}
    for name, _module, state in sorted(states, key=lambda s: (-s[0].count(".") if s[0] else 1, order[s[0]])):
        mp = state._mp_policy
        params = [fp.sharded_param for fp in _fsdp_params(state)]
        dtypes = {p.dtype for p in params}
        stored = max(dtypes, key=lambda d: sum(_global_numel(p) for p in params if p.dtype == d)) if dtypes else None
        gather = mp.param_dtype or stored or torch.float32
        for p in params:
            gather_of[id(p)] = mp.param_dtype or p.dtype
        mine = planned.get(name)
        kind = mine.kind if mine is not None else ("root" if not name else "unit")
        records.append(
            UnitPlan(
                name=name,
                kind=kind,
                params=sum(_global_numel(p) for p in params),
                stored=stored,
                gather=gather,
                compute=gather,
                reduce=mp.reduce_dtype or gather,
                output=mp.output_dtype,
                inputs=mine.inputs
                if mine is not None
                else (mp.param_dtype if (mp.cast_forward_inputs and mp.param_dtype is not None) else None),
                reason=mine.reason if mine is not None else "torch fully_shard",
                saturate=mine.saturate if mine is not None else False,
            )
        )
    # castwise's plan also holds units that needed no FSDP2 state (islands owning no parameter)
    have = {r.name for r in records}
    records[:-1] = records[:-1] + [u for u in (plan.units if plan else ()) if u.name not in have and u.name]
    return records, gather_of


def mixed_unit_findings(model: nn.Module, modes: tuple[Any, ...]) -> list[Finding]:
    """A CW113 error per FSDP2 unit whose trainable parameters are stored in more than one dtype:
    torch's FSDP2 refuses that at the unit's first forward (``FSDPParamGroup._init_mp_dtypes``:
    "FSDP expects uniform original parameter dtype"), whatever its ``MixedPrecisionPolicy``, so
    the run stops before any op; the view gathers them all in one dtype and would pass."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    found: list[Finding] = []
    for unit, _module, state in _states(model):
        trainable = [fp.sharded_param for fp in _fsdp_params(state) if fp.sharded_param.requires_grad]
        by_dtype: Counter[torch.dtype] = Counter()
        for p in trainable:
            by_dtype[p.dtype] += _global_numel(p)
        if len(by_dtype) < 2:
            continue
        usual = by_dtype.most_common(1)[0][0]
        odd = [names.get(id(p), "?") for p in trainable if p.dtype != usual]
        owner = odd[0].rpartition(".")[0]
        odd_dtype = next(p.dtype for p in trainable if p.dtype != usual)
        where = f"`{unit}`" if unit else "the root unit"
        shown = ", ".join(sorted(str(d) for d in by_dtype))
        found.append(
            Finding(
                code="CW113",
                message=(
                    f"FSDP2 unit {where} holds trainable parameters in {short_of(odd_dtype)} (`{odd[0]}`"
                    f"{f' and {len(odd) - 1} more' if len(odd) > 1 else ''}) and {short_of(usual)}: torch's "
                    f"fully_shard refuses it at the unit's first forward (AssertionError: FSDP expects uniform "
                    f"original parameter dtype but got {{{shown}}}), before any op runs."
                ),
                module=owner,
                origin=Origin(owner or None, None, f"param {odd[0]}"),
                modes=modes,
                fix=(
                    f"Cast `{owner or 'the model'}` to {short_of(usual)} with the rest of the unit before "
                    f"fully_shard, or make it its own unit (fully_shard(model.{owner}) first) if it is meant "
                    f"to be stored in {short_of(odd_dtype)}."
                ),
            )
        )
    return found


# -- the view ----------------------------------------------------------------------------------


def _plain_class(module: nn.Module) -> type:
    """The module's class before FSDP2 swapped in its ``FSDP<Class>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        return next(b for b in cls.__bases__ if not issubclass(b, FSDPModule))
    return cls


def _foreign_hook(fn: Any) -> bool:
    """Hooks torch.distributed put on a module (FSDP2's pre/post-forward), not the user's."""
    fn = getattr(fn, "__func__", fn)
    return str(getattr(fn, "__module__", "") or "").startswith("torch.distributed")


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _view_module(
    module: nn.Module,
    gather: Callable[[torch.Tensor, str], torch.dtype],
    memo: dict[Any, torch.Tensor],
    prefix: str,
    wrapped: fsdp1.Wrapped | None = None,
    shapes: dict[int, tuple[int, ...]] | None = None,
) -> nn.Module:
    from torch import nn

    cls = _plain_class(module) if "torch.distributed.fsdp" in sys.modules else type(module)
    new: nn.Module = object.__new__(cls)
    state = {k: v for k, v in module.__dict__.items() if not k.startswith(_STATE_KEY)}
    state.pop("_is_fsdp_managed_module", None)
    state.pop("_fsdp_use_orig_params", None)
    if getattr(state.get("forward"), "__castwise_fsdp2__", False):
        state.pop("forward")  # castwise.fsdp2's boundary casts: the view adds its own
    for key in _HOOK_DICTS:
        hooks = state.get(key)
        if isinstance(hooks, dict):
            state[key] = type(hooks)((k, v) for k, v in hooks.items() if tp.user_style_hook(v) or not _foreign_hook(v))
    originals = wrapped.params.get(id(module), {}) if wrapped is not None else {}
    flat = getattr(sys.modules.get("torch.distributed.fsdp._flat_param"), "FlatParameter", None)
    params: dict[str, nn.Parameter | None] = {}
    for pname, p in module._parameters.items():
        if pname in originals or (flat is not None and isinstance(p, flat)):
            continue  # FSDP1's flat storage and its views: the original parameters come below
        if p is None:
            params[pname] = None
            continue
        if id(p) not in memo:
            dtype = gather(p, prefix + pname) if p.is_floating_point() else p.dtype
            shape = (shapes or {}).get(id(p), tuple(p.shape))  # TP: this rank's local shard
            memo[id(p)] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad)
        params[pname] = memo[id(p)]  # type: ignore[assignment]
    for pname, spec in originals.items():
        state.pop(pname, None)  # FSDP1 sets unsharded views as plain attributes during its forward
        if spec.key not in memo:
            empty = torch.empty(spec.shape, dtype=spec.gather, device="meta")
            memo[spec.key] = nn.Parameter(empty, requires_grad=spec.requires_grad)
        params[pname] = memo[spec.key]  # type: ignore[assignment]
    state["_parameters"] = type(module._parameters)(params)
    cast = wrapped.buffers if wrapped is not None else {}
    state["_buffers"] = type(module._buffers)(
        (n, b.to(cast[id(b)]) if b is not None and id(b) in cast else b) for n, b in module._buffers.items()
    )
    children = ((n, None if c is None else _user_module(c)) for n, c in module._modules.items())
    state["_modules"] = type(module._modules)(
        (n, None if c is None else _view_module(c, gather, memo, f"{prefix}{n}.", wrapped, shapes)) for n, c in children
    )
    for key, value in list(state.items()):
        if isinstance(value, types.MethodType) and value.__self__ is module:
            # bound to the user's module (Accelerate's forward with its autocast): to the view's
            state[key] = types.MethodType(value.__func__, new)
    new.__dict__.update(state)
    return new


def _user_module(module: nn.Module) -> nn.Module:
    """The user's module behind FSDP1's wrapper and torch.compile's ``OptimizedModule`` (a block
    compiled before sharding, as torchtitan does): a copy of an OptimizedModule is rebuilt around
    its ``_orig_mod``, without the view's boundary casts, so the view holds the block itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    while True:
        module = fsdp1.unwrap(module)
        if optimized is None or not isinstance(module, optimized):
            return module
        module = module._orig_mod


# unit name -> dtypes of its outputs before its output cast, while a distributed audit runs
def _boundary(
    unit: str | None,
    inputs: torch.dtype | None,
    output: torch.dtype | None,
    saturate: bool,
    restore: bool = False,
    own: Callable[..., Any] | None = None,
    seen: unit_runs.Seen | None = None,
) -> Callable[..., Any]:
    """A forward doing what FSDP2 does at a unit's boundary: floating inputs cast to the gather
    dtype (``cast_forward_inputs``), outputs to ``output_dtype`` (clamped first where castwise
    saturates an island's return to f16). It records what the unit computed, its output's dtype
    before the cast, in ``seen``. Bound to the view's module, so deep copies rebind (and share ``seen``).
    ``restore`` (FSDP1's modules run with mixed precision off): only positional inputs are cast,
    and the output goes back to the dtype of the last input that was cast. ``own``: the module's
    own forward function when one was set on the instance (Accelerate's, with its autocast),
    which the boundary runs instead of the class's."""
    from castwise.applied import cast_floating, saturated

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with unit_runs.unit_call(module):
            return _cast_and_run(module, args, kwargs)

    def _cast_and_run(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        came_in = None
        if restore and inputs is not None:
            floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            cast = [d for d in floats if d != inputs]
            came_in = cast[-1] if cast else None
            args = cast_floating(args, inputs)
        elif inputs is not None:
            if seen is not None and unit is not None:  # CW172: a position table narrowed by the cast
                scale_rules.note_tables(seen.narrowed, unit, own or type(module).forward, args, kwargs, inputs)
            args, kwargs = cast_floating((args, kwargs), inputs)
        out = (own or type(module).forward)(module, *args, **kwargs)
        if came_in is not None:
            out = cast_floating(out, came_in)
        first = _first_float(out) if seen is not None and unit is not None else None
        if first is not None and seen is not None and unit is not None:
            seen.computed.setdefault(unit, Counter())[first.dtype] += 1
        if saturate:
            out = saturated(cast_floating(out, torch.float32))
        return cast_floating(out, output) if output is not None else out

    return forward


def _first_float(obj: Any) -> torch.Tensor | None:
    return next((t for t in tensors_of(obj) if t.is_floating_point()), None)


def build_view(
    model: nn.Module,
    records: list[UnitPlan],
    gather: Callable[[torch.Tensor, str], torch.dtype],
    output_rules: tuple[tuple[str, torch.dtype], ...] = (),
    wrapped: fsdp1.Wrapped | None = None,
    reshards: dict[str, bool | None] | None = None,
    seen: unit_runs.Seen | None = None,
    tensor_parallel: tp.TensorParallel | None = None,
) -> nn.Module:
    """The unsharded model computing in the units' dtypes (see the module docstring); ``wrapped``:
    what FSDP1's wrappers do, for a model wrapped by FSDP1; ``seen``: what its runs record;
    ``tensor_parallel``: local shard shapes and TP styles (tp.py), for a TP plan."""
    shapes = tensor_parallel.shapes if tensor_parallel is not None else None
    view = _view_module(fsdp1.unwrap(model) if wrapped is not None else model, gather, {}, "", wrapped, shapes)
    if tensor_parallel is not None:
        tp.install(view, tensor_parallel.styles, tensor_parallel.collectives)
    restore = wrapped.restore if wrapped is not None else frozenset()
    for u in records:  # every unit gets one: it also records what the unit computed
        module = view.get_submodule(u.name) if u.name else view
        own = module.__dict__.get("forward")
        own_func = own.__func__ if isinstance(own, types.MethodType) and own.__self__ is module else None
        boundary = _boundary(u.name, u.inputs, u.output, u.saturate, u.name in restore, own_func, seen)
        module.forward = types.MethodType(boundary, module)  # type: ignore[method-assign]
    for name, dtype in output_rules:
        module = view.get_submodule(name) if name else view
        if "forward" not in module.__dict__:
            module.forward = types.MethodType(_boundary(None, None, dtype, False), module)  # type: ignore[method-assign]
    unit_runs.watch(view, records, reshards or {}, seen)
    return view


# -- the audit ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharded:
    """A distributed setup ready to audit: its ``setup``, the ``view`` to audit, and what the
    view's runs record in ``seen`` (each unit's compute dtype, modules run outside their unit)."""

    setup: _Setup
    view: nn.Module
    seen: unit_runs.Seen
    policy: Policy | str | None = None  # a TP plan without FSDP: the user's policy, audited on the view


def prepare(
    model: nn.Module, policy: Policy | str | None, world_size: int | None, units: list[str] | None, fake: bool
) -> Sharded:
    """The view of ``model`` sharded (FSDP2, FSDP1) or planned under ``policy`` (see the module docstring)."""
    if not fake:
        raise AuditError(
            "a distributed audit runs on fake tensors (the sharded weights are on other ranks); "
            "pass fake=True (the default)"
        )
    setup = (
        _sharded_setup(model, policy, world_size)
        if is_sharded(model)
        else _planned_setup(model, policy, units, world_size)
    )
    seen = unit_runs.Seen()
    view = build_view(
        model, setup.records, setup.gather, setup.output_rules, setup.wrapped, setup.reshards, seen, setup.tp
    )
    return Sharded(setup, view, seen, policy if setup.tp is not None and not setup.records else None)


def finish(model: nn.Module, sharded: Sharded, report: Report) -> Report:
    """The audit of the view as the distributed setup's: per-unit records as its runs saw them
    (a unit they never reached: as planned), titles and runs naming the engine, unit findings."""
    setup, computed = sharded.setup, sharded.seen.computed
    records = [
        replace(u, compute=computed[u.name].most_common(1)[0][0]) if u.name in computed else u for u in setup.records
    ]
    torch_own = "torch FullyShardedDataParallel" if setup.wrapped is not None else "torch fully_shard"
    shown = str(setup.plan.policy) if setup.plan is not None else torch_own
    if setup.tp is not None and not records:  # TP alone: the policy (if any) is the audit's own
        report.title = report.title.replace("policy ", f"{setup.what}, policy ", 1)
        shown = f"torch parallelize_module+{sharded.policy or 'none'}"
    else:
        report.title = report.title.replace("policy none", f"{setup.what}, policy {shown}")
    engine = "fsdp1" if setup.wrapped is not None else ("fsdp2" if records else "tp")
    report.runs = [replace(r, policy=f"{engine}:{shown}") for r in report.runs]
    report.extra["units"] = [_unit_dict(u, setup.world) for u in records]
    if setup.tp is not None:
        report.extra["collectives"] = setup.tp.collectives.to_list()
        report.extra["mesh"] = setup.what
        modes = tuple(dict.fromkeys(r.mode for r in report.runs))
        policy = sharded.policy if sharded.policy is not None else (setup.plan.policy if setup.plan else None)
        report.findings = [*scale_rules.tp_gemm_findings(model, setup.tp, policy, modes), *report.findings]
        report.findings = [*scale_rules.float8_tp_amax_findings(model, modes), *report.findings]
    modes = tuple(dict.fromkeys(r.mode for r in report.runs))
    if is_sharded(model):
        report.findings = [*mixed_unit_findings(model, modes), *report.findings]
        gathered = [(n, fp) for n, _m, state in _states(model) for fp in _fsdp_params(state)]
        report.findings = [*scale_rules.fp8_gather_findings(model, gathered, modes), *report.findings]
    report.findings = [*scale_rules.table_findings(sharded.seen.narrowed, modes), *report.findings]
    report.findings = [*unit_runs.outside_findings(sharded.seen.outside), *report.findings]
    return report


@dataclass(frozen=True)
class _Setup:
    """What a distributed audit needs to know of the sharding: the plan (None for a model sharded
    by torch's own fully_shard), the units, each parameter's gathered dtype, the output rules."""

    plan: Plan | None
    records: list[UnitPlan]
    gather: Callable[[torch.Tensor, str], torch.dtype]
    output_rules: tuple[tuple[str, torch.dtype], ...]
    world: int
    what: str
    wrapped: fsdp1.Wrapped | None = None  # a model wrapped by FSDP1: what its wrappers do
    reshards: dict[str, bool | None] | None = None  # unit -> frees its parameters after forward
    tp: tp.TensorParallel | None = None  # a TP plan (with FSDP2 or alone): local shards, styles


def _sharded_setup(model: nn.Module, policy: Policy | str | None, world_size: int | None) -> _Setup:
    """A model already sharded by FSDP2: its units and dtypes are read from its FSDP states; one
    wrapped by FSDP1, from its wrappers."""
    from castwise import fsdp2

    if fsdp1.is_wrapped(model):
        if policy is not None:
            raise AuditError(
                f"{type(model).__name__} is wrapped by FSDP1: its wrappers' MixedPrecision decide the dtypes; "
                "audit it with policy=None, or audit the unwrapped model with the policy"
            )
        wrapped = fsdp1.read(model)
        world = world_size or wrapped.world
        what = f"FSDP1 over {world} ranks"
        return _Setup(None, wrapped.units, lambda p, name: p.dtype, (), world, what, wrapped, wrapped.reshards)

    plan = fsdp2.plan_of(model)
    specs = {
        id(fp.sharded_param): (fp._unsharded_dtensor_spec if getattr(fp, "is_dtensor", False) else None)
        for _name, _module, state in _states(model)
        for fp in _fsdp_params(state)
    }
    tensor_parallel = tp.read(model, specs)
    if not specs and tensor_parallel is not None:  # TP alone: no unit, parameters in their own dtypes
        world = world_size or _mesh_size(model)
        return _Setup(None, [], lambda p, name: p.dtype, (), world, tensor_parallel.title, tp=tensor_parallel)
    if policy is not None and (plan is None or Policy.parse(policy) != plan.policy):
        sharded_with = f"castwise policy {plan.policy}" if plan is not None else "torch's fully_shard"
        raise AuditError(
            f"{type(model).__name__} is sharded by FSDP2 ({sharded_with}): its units' MixedPrecisionPolicy decide "
            "the dtypes; audit it with policy=None, or audit the unsharded model with the policy"
        )
    records, gathered = records_of(model)

    def gather(p: torch.Tensor, name: str) -> torch.dtype:
        return gathered.get(id(p), p.dtype)

    world = world_size or _mesh_size(model)
    out_rules = plan.output_rules if plan is not None else ()
    # a unit whose FSDP2 state has no post-forward mesh keeps its parameters after forward
    reshards: dict[str, bool | None] = {
        name: getattr(getattr(state, "_fsdp_param_group", None), "post_forward_mesh_info", True) is not None
        for name, _module, state in _states(model)
    }
    what = tensor_parallel.title if tensor_parallel is not None else f"FSDP2 over {world} ranks"
    return _Setup(plan, records, gather, out_rules, world, what, None, reshards, tensor_parallel)


def _planned_setup(
    model: nn.Module, policy: Policy | str | None, units: list[str] | None, world_size: int | None
) -> _Setup:
    """An unsharded model: the units and dtypes of the plan ``castwise.fsdp2.fully_shard`` would apply."""
    if policy is None:
        raise AuditError(
            f"{type(model).__name__} is not sharded by FSDP2; pass the policy castwise.fsdp2 would "
            "shard it with (policy='bf16-mixed', ...), or audit it with castwise.audit"
        )
    plan = make_plan(model, policy, units)
    records = list(plan.units)
    names = [u.name for u in records]
    by_unit = {u.name: u for u in records}

    def gather(p: torch.Tensor, name: str) -> torch.dtype:
        return by_unit[unit_runs.unit_of(name, names)].gather

    world = world_size or 1
    return _Setup(plan, records, gather, plan.output_rules, world, f"FSDP2 plan over {world} ranks")


def candidate(policy: Policy, found: Policy) -> Policy | None:
    """The sharding policy with the rules the audit of the view points at (the view's own
    suggestion is for castwise.apply on a model already in the gathered dtypes); None: nothing new."""
    extra = [r for r in found.rules if r not in policy.rules]
    out = policy.with_rules(*extra) if extra else policy
    if not found.fastpath:
        out = out.replace(fastpath=False)
    return None if out == policy else out


def _unit_dict(u: UnitPlan, world: int) -> dict[str, Any]:
    out = u.to_dict()
    stored = _BYTES.get(u.stored, 4) if u.stored is not None else 0
    out["bytes_per_rank"] = -(-u.params // world) * stored
    out["gather_bytes"] = u.params * _BYTES.get(u.gather, 4)
    return out


def _mesh_size(model: nn.Module) -> int:
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    return 1
