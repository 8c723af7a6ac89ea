"""FSDP2 under a castwise policy: one ``MixedPrecisionPolicy`` per unit, islands as own units.

>>> print(castwise.fsdp2.plan(model, "bf16-true"))        # no process group needed
>>> castwise.fsdp2.fully_shard(model, "bf16-mixed,keep[*.router]=f32,reduce=f32")

Under FSDP2 a module's parameters are all-gathered in the ``param_dtype`` of the unit that owns
them, so an fp32 island inside a bf16 unit is gathered in bf16 whatever casts surround it:
islands must be their own units. ``plan`` says per unit what it stores, gathers, computes,
reduces and casts (see ``castwise.distributed.plan`` for the layout and why); ``fully_shard``
does it. ``torch.distributed`` is imported only when these are called.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from castwise.distributed.plan import Plan, ShardError, UnitPlan, make_plan
from castwise.policy import Policy

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Plan", "ShardError", "UnitPlan", "fully_shard", "plan", "plan_of"]

# sharded model -> the plan castwise sharded it with (read by the distributed audit)
_SHARDED: weakref.WeakKeyDictionary[nn.Module, Plan] = weakref.WeakKeyDictionary()


def plan(model: nn.Module, policy: Policy | str, *, units: Sequence[str] | None = None) -> Plan:
    """What ``fully_shard(model, policy, units=units)`` would do, per unit; changes nothing and
    needs no process group. ``print()`` it for a table; ``.to_dict()`` for JSON."""
    return make_plan(model, policy, units)


def plan_of(model: nn.Module) -> Plan | None:
    """The plan ``castwise.fsdp2.fully_shard`` sharded ``model`` with (None: not sharded by castwise)."""
    return _SHARDED.get(model)


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _check(model: nn.Module, mesh: Any) -> None:
    import torch.distributed as dist

    from castwise.applied import applied_to

    if any(_is_fsdp(m) for m in model.modules()):
        raise ShardError(
            f"{type(model).__name__} is already sharded by FSDP2; castwise.fsdp2.fully_shard shards an unsharded "
            "model (it decides every unit's MixedPrecisionPolicy): call it instead of torch's fully_shard"
        )
    applied = applied_to(model)
    if applied is not None:
        raise ShardError(
            f"{type(model).__name__} is under castwise.apply (policy {applied.policy}); under FSDP2 the gather "
            "does the casting: call .remove() on the Applied and pass the policy to castwise.fsdp2.fully_shard"
        )
    if not dist.is_available():
        raise ShardError("this torch build has no torch.distributed; castwise.fsdp2.plan works without it")
    if mesh is None and not dist.is_initialized():
        raise ShardError(
            "fully_shard needs a process group: call torch.distributed.init_process_group(...) first (or pass "
            "mesh=init_device_mesh(...)); to see what it would do without one, print(castwise.fsdp2.plan(model, "
            "policy))"
        )


def _wrap_forward(module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """An instance ``forward`` wrapping the current one (FSDP2's hooks stay around it)."""
    inner = module.forward
    wrapped = make(inner)
    functools.update_wrapper(wrapped, inner)

    def forward(_self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    forward.__castwise_fsdp2__ = True  # type: ignore[attr-defined]  # the distributed audit's view drops these
    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]


def _cast_out(dtype: torch.dtype | None, saturate: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Cast floating outputs to ``dtype`` (None: keep); ``saturate``: clamp to f16's finite range
    first, so a value the f32 island was kept for (an f16 overflow) does not come back as inf.
    (FSDP2's own ``output_dtype`` cast is plain.)"""
    from castwise.applied import cast_floating, saturated

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if saturate:
                out = saturated(out)
            return cast_floating(out, dtype) if dtype is not None else out

        return forward

    return make


def _cast_in(dtype: torch.dtype) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    from castwise.applied import cast_floating

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = cast_floating((args, kwargs), dtype)
            return inner(*args, **kwargs)

        return forward

    return make


def _cast_tensors(model: nn.Module, p: Plan) -> None:
    for c in p.param_casts:
        param = model.get_parameter(c.name)
        param.data = param.data.to(c.after)
    for c in p.buffers:
        owner, _, name = c.name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[name] = module._buffers[name].to(c.after)  # type: ignore[union-attr]


def fully_shard(
    model: nn.Module, policy: Policy | str, *, mesh: Any = None, units: Sequence[str] | None = None
) -> nn.Module:
    """Shard ``model`` with FSDP2, one unit per island, per repeated block (or per ``units``
    selector) and the root, each with the ``MixedPrecisionPolicy`` the castwise ``policy`` implies
    (``castwise.fsdp2.plan`` prints them). In place; returns ``model``. ``mesh``: a DeviceMesh
    (default: FSDP2's, over the default process group).

    Parameters are cast first where the policy stores them in another dtype (islands in f32,
    everything in bf16 under ``bf16-true``), buffers as ``castwise.apply`` casts them (FSDP2
    leaves buffers alone), ``out[...]`` rules become output casts. No autocast is entered: the
    gather in the compute dtype is the mixed precision.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    p = make_plan(model, policy, units)
    _check(model, mesh)
    _cast_tensors(model, p)
    for name, dtype in p.output_rules:
        _wrap_forward(model.get_submodule(name) if name else model, _cast_out(dtype, False))
    for u in p.units:
        module = model.get_submodule(u.name) if u.name else model
        if u.kind == "island" and u.params == 0:
            # nothing to gather: castwise's own casts at the boundary do the island's job
            _wrap_forward(module, _cast_out(u.output, u.saturate))
            _wrap_forward(module, _cast_in(u.gather))
            continue
        if u.saturate:
            _wrap_forward(module, _cast_out(None, True))
        if u.inputs is not None and u.inputs != u.gather:
            _wrap_forward(module, _cast_in(u.inputs))
        torch_fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(**u.mp_policy_kwargs()))
    _SHARDED[model] = p
    return model
