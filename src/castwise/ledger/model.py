"""The ledger of a model and its real optimizer: one optimizer step on a copy, then
``optimizer.state`` read as it is (imports torch).

The step runs on a deep copy of the model (the user's weights never move) with gradients of
each parameter's ``grad_dtype`` (torch's ``Tensor.grad_dtype``, else the parameter's dtype),
small and random: what the optimizer allocates on its first step is the state it keeps. The
copy's ``state_dict()`` round trip gives the checkpoint dtypes, and the optimizer's own
``state_dict()`` / ``load_state_dict()`` round trip says whether a resume changes a state's
precision (torch's ``Optimizer.load_state_dict`` casts floating state to the parameter's dtype).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise._dtypes import name_of
from castwise.errors import CastwiseError
from castwise.ledger.values import UNKNOWN, Entry, Ledger, group_rows

__all__ = [
    "OptimizerSpec",
    "StepResult",
    "keeps_precision",
    "ledger_from_model",
    "ledger_of",
    "row_entries",
    "spec_of",
    "step_copy",
]

_SCHEME = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
_LOW_BIT = (("4bit", "4-bit"), ("8bit", "8-bit"), ("fp8", "fp8"))


@dataclass(frozen=True)
class OptimizerSpec:
    """The user's optimizer as a class and its param groups' settings (by parameter name)."""

    cls: Callable[..., torch.optim.Optimizer]
    groups: tuple[tuple[tuple[str, ...], Mapping[str, Any]], ...]

    @staticmethod
    def of(model: nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerSpec:
        names = {id(p): n for n, p in model.named_parameters()}
        groups = []
        for g in optimizer.param_groups:
            params = tuple(names[id(p)] for p in g["params"] if id(p) in names)
            groups.append((params, {k: v for k, v in g.items() if k != "params"}))
        return OptimizerSpec(type(optimizer), tuple(groups))

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        return self.build_on(dict(model.named_parameters()))

    def build_on(self, params: Mapping[str, torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (by name; groups keep their settings, names absent here
        are left out: a sample of the parameters steps as the whole would)."""
        groups = [
            {"params": [params[n] for n in names if n in params], **kw}
            for names, kw in self.groups
            if any(n in params for n in names)
        ]
        try:
            return self.cls(groups)
        except TypeError as exc:  # an optimizer that takes extra settings at construction only
            raise CastwiseError(f"cannot rebuild {self.name} on the model's copy: {exc}") from None

    def group_of(self, name: str) -> int | None:
        """The index of the param group that holds parameter ``name`` (None: in none)."""
        return next((i for i, (names, _) in enumerate(self.groups) if name in names), None)

    @property
    def name(self) -> str:
        return f"{getattr(self.cls, '__module__', '')}.{getattr(self.cls, '__name__', repr(self.cls))}"


@dataclass(frozen=True)
class StepResult:
    """The copy after one step, its optimizer, and what a resume made of the state."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    before: dict[str, torch.Tensor]
    resumed: torch.optim.Optimizer | None


def _grad_dtype(p: nn.Parameter) -> torch.dtype:
    dt = getattr(p, "grad_dtype", None)
    return dt if isinstance(dt, torch.dtype) else p.dtype


def step_copy(
    model: nn.Module,
    spec: OptimizerSpec,
    grad_scale: float = 1e-3,
    seed: int = 0,
    *,
    grads: Mapping[str, torch.Tensor] | None = None,
    grad_dtypes: Mapping[str, torch.dtype] | None = None,
    in_place: bool = False,
) -> StepResult:
    """One real optimizer step on a deep copy (``in_place``: on ``model`` itself, a copy the
    caller owns), with ``grads`` where given (a run's own gradients: parameters without one do not
    step), else small random ones of ``grad_dtypes[name]`` (the dtype a run's backward made), else
    of the parameter's grad_dtype."""
    twin = model if in_place else copy.deepcopy(model)
    if not in_place:
        for (_, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
            dt = getattr(p, "grad_dtype", None)
            if isinstance(dt, torch.dtype) and dt != p.dtype:
                q.grad_dtype = dt  # deepcopy does not carry torch's grad_dtype
    opt = spec.build(twin)
    gen = torch.Generator().manual_seed(seed)
    before = {}
    for n, p in twin.named_parameters():
        if not p.requires_grad or (grads is not None and n not in grads):
            continue  # a run's parameter its backward did not reach: the step skips it too
        before[n] = p.detach().clone()
        if grads is not None:
            p.grad = grads[n]
            continue
        dtype = (grad_dtypes or {}).get(n) or _grad_dtype(p)
        if p.device.type == "meta":
            # a model built on the meta device (a config target, a 7B): the step runs on meta
            # tensors, which carry every dtype the optimizer allocates and no values
            p.grad = torch.empty(p.shape, dtype=dtype, device="meta")
            continue
        g = torch.randn(p.shape, generator=gen, dtype=torch.float32) * grad_scale
        p.grad = g.to(device=p.device, dtype=dtype)
    opt.step()
    resumed: torch.optim.Optimizer | None
    try:
        # fresh parameters for a fresh optimizer, as a resumed run builds it (no copy of the model)
        fresh = {n: nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for n, p in twin.named_parameters()}
        resumed = spec.build_on(fresh)
        resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    except (RuntimeError, ValueError, KeyError, TypeError):
        resumed = None  # an optimizer whose state does not round-trip: the resume field stays unknown
    return StepResult(twin, opt, before, resumed)


def _state_tensors(state: Mapping[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-element state of ``p``: tensors of its shape (not ``step``, not scalars)."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == p.numel() and k != "step"}


def _describe(t: torch.Tensor) -> tuple[str, str]:
    """(state dtype, scheme) of one state tensor: a low-bit subclass by its codes' dtype."""
    kind = type(t).__name__.lower()
    for mark, scheme in _LOW_BIT:
        if mark in kind:
            codes = getattr(t, "codes", None)
            return (name_of(codes.dtype) if isinstance(codes, torch.Tensor) else UNKNOWN), scheme
    dt = name_of(t.dtype)
    return dt, _SCHEME.get(dt, dt)


def _state_entries(opt: torch.optim.Optimizer, p: torch.Tensor, who: str) -> tuple[Entry, Entry, Entry, Entry]:
    """state, scheme, master and rounding of one parameter, as the optimizer keeps them."""
    state = opt.state.get(p, {})
    tensors = _state_tensors(state, p)
    if not tensors:
        return Entry("none", who, "no per-element state"), Entry("none", who), Entry("none", who), Entry("none", who)
    described = {k: _describe(v) for k, v in tensors.items() if "master" not in k and "comp" not in k}
    dts = sorted({d for d, _ in described.values()})
    schemes = sorted({s for _, s in described.values()})
    keys = ", ".join(sorted(described))
    state_e = Entry(dts[0] if len(dts) == 1 else "/".join(dts), who, f"optimizer.state: {keys}")
    scheme_e = Entry(schemes[0] if len(schemes) == 1 else "/".join(schemes), who, f"optimizer.state: {keys}")
    master = next((v for k, v in tensors.items() if "master" in k or k in ("fp32_param", "main_param")), None)
    master_e = Entry(name_of(master.dtype), who, "a master copy in optimizer.state") if master is not None else None
    group = next((g for g in opt.param_groups if any(q is p for q in g["params"])), {})
    sr = bool(group.get("bf16_stochastic_round", getattr(opt, "bf16_stochastic_round", False)))
    kahan = next((k for k in tensors if "comp" in k or "kahan" in k), None)
    if kahan is not None:
        rounding = Entry("kahan", who, f"optimizer.state[{kahan!r}] carries the rounding error")
    elif sr and p.dtype == torch.bfloat16:
        rounding = Entry("stochastic", who, "bf16_stochastic_round=True")
    else:
        rounding = Entry("none", who, "round to nearest")
    return state_e, scheme_e, master_e or Entry("none", who, "the parameter itself is updated"), rounding


def row_entries(
    name: str, p: torch.Tensor, optimizer: torch.optim.Optimizer, saved: torch.Tensor | None, who: str
) -> dict[str, Entry]:
    """The ledger fields of parameter ``name`` after a step of ``optimizer`` (``saved``: what
    ``state_dict()`` holds for it)."""
    stored = name_of(p.dtype)
    grad = p.grad
    state, scheme, master, rounding = _state_entries(optimizer, p, who)
    return {
        "storage": Entry(stored, "parameter dtype"),
        "compute": Entry(UNKNOWN, "", "castwise audit measures what each op computes in"),
        "gradient": Entry(name_of(grad.dtype) if grad is not None else UNKNOWN, "param.grad (grad_dtype)"),
        "reduction": Entry(UNKNOWN, "", "no distributed wrapper given"),
        "master": master,
        "state": state,
        "scheme": scheme,
        "rounding": rounding,
        "checkpoint_save": Entry(name_of(saved.dtype) if saved is not None else UNKNOWN, "model.state_dict()"),
        "checkpoint_load": Entry(stored, "load_state_dict", "copied into the existing parameter, keeping its dtype"),
    }


def keeps_precision(entries: Mapping[str, Entry]) -> bool:
    """Whether a row's update survives storage rounding by design: a wider master copy, stochastic
    rounding or Kahan summation (one step of those may leave a weight unchanged, on purpose)."""
    return entries["master"].value not in ("none", UNKNOWN) or entries["rounding"].value in ("stochastic", "kahan")


def spec_of(
    model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerSpec | Callable[[nn.Module], torch.optim.Optimizer]
) -> OptimizerSpec:
    """The optimizer as a spec: an instance over the model's parameters, a spec, or a function
    building one on a model (called on ``model``: optimizers allocate state at their first step)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return OptimizerSpec.of(model, optimizer)
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    built = optimizer(model)
    if not isinstance(built, torch.optim.Optimizer):
        raise CastwiseError(
            f"optimizer: the function returned {type(built).__name__}, not a torch.optim.Optimizer; give an "
            "optimizer over the model's parameters, a torch.optim class, or a function model -> optimizer"
        )
    return OptimizerSpec.of(model, built)


def ledger_of(result: StepResult, spec: OptimizerSpec, source: str, alias: Mapping[str, str] | None = None) -> Ledger:
    """The ledger of a step's result: one row per group of parameters whose fields are equal
    (``alias``: a parameter that did not step -> the one that stepped for it, whose fields it has)."""
    who = f"{spec.name.rsplit('.', 1)[-1]} after one step"
    saved = result.model.state_dict(keep_vars=True)
    params = dict(result.model.named_parameters())
    entries: dict[str, dict[str, Entry]] = {}
    per = []
    for n in params:
        if n not in result.before:
            continue
        rep = (alias or {}).get(n, n)
        if rep not in entries:
            entries[rep] = row_entries(rep, params[rep], result.optimizer, saved.get(rep), who)
        per.append((n, entries[rep]))
    return Ledger(group_rows(per), f"{source} with {spec.name}")


def ledger_from_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerSpec | Callable[[nn.Module], torch.optim.Optimizer],
    source: str = "model",
) -> tuple[Ledger, StepResult]:
    """The ledger of ``model`` trained by ``optimizer`` (an instance over the model's
    parameters, an OptimizerSpec, or a function building one on a model)."""
    spec = spec_of(model, optimizer)
    result = step_copy(model, spec)
    return ledger_of(result, spec, source), result
