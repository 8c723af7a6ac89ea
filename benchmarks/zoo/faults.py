"""Fault classes planted into real models: the dtype bugs users report, at a random depth, seeded.

Each class has ``plant(model, rng) -> PlantedFault`` (raises ``NotApplicable`` when the model has
no place for it) and the situations it makes sense in. A fault changes the model the way a user
does (``.float()`` on one module, a hook, a plain tensor attribute, a forward that upcasts...),
always deep-copyably: forwards are changed by swapping the module's class for a subclass, hooks
are module-level functions, so a copy of the model carries the fault the way the original does.
``expected_origin`` is the module the user changed: where a correct diagnosis points.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from benchmarks.zoo.situations import HAND_LOW, MIXED, TRUE
from torch import nn
from torch.utils._pytree import tree_map_only

F32 = torch.float32


class NotApplicable(Exception):
    """The model has no module this fault can be planted in."""


@dataclass(frozen=True)
class PlantedFault:
    module_name: str
    cls: str
    description: str
    expected_origin: str
    depth: int


@dataclass(frozen=True)
class FaultClass:
    name: str
    situations: tuple[str, ...]
    plant: Callable[[nn.Module, random.Random], PlantedFault]
    doc: str


# -- helpers --------------------------------------------------------------------------------------


def _floating(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: fn(t) if t.is_floating_point() else t, obj)


def _own_weight(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters(recurse=False))


def _runs_forward(module: nn.Module) -> bool:
    return not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict))


def pick(model: nn.Module, rng: random.Random, predicate: Callable[[str, nn.Module], bool]) -> tuple[str, nn.Module]:
    """A module matching ``predicate`` at a random depth: first a depth, uniformly among the
    depths that have one, then a module there (so deep and shallow places are drawn alike)."""
    by_depth: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if name and _runs_forward(module) and predicate(name, module):
            by_depth.setdefault(name.count("."), []).append((name, module))
    if not by_depth:
        raise NotApplicable("no module matches")
    depth = rng.choice(sorted(by_depth))
    return rng.choice(by_depth[depth])


def _fault(name: str, cls: str, description: str, origin: str | None = None) -> PlantedFault:
    return PlantedFault(name, cls, description, origin if origin is not None else name, name.count("."))


_SUBCLASSES: dict[tuple[type, str], type] = {}


def _swap_forward(module: nn.Module, kind: str) -> None:
    """Give ``module`` a subclass whose forward is WRAPPERS[kind] around its own."""
    base = type(module)
    key = (base, kind)
    if key not in _SUBCLASSES:
        wrapper = WRAPPERS[kind]

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return wrapper(self, base.forward, args, kwargs)

        _SUBCLASSES[key] = type(f"{base.__name__}_{kind}", (base,), {"forward": forward})
    module.__class__ = _SUBCLASSES[key]


Forward = Callable[..., Any]


def _w_upcast_inputs(self: nn.Module, fwd: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fwd(self, *_floating(lambda t: t.float(), args), **_floating(lambda t: t.float(), kwargs))


def _w_factory(self: nn.Module, fwd: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _floating(lambda t: t + torch.zeros(t.shape), fwd(self, *args, **kwargs))  # default dtype: f32


def _w_scale_attr(self: nn.Module, fwd: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    scale: torch.Tensor = self.cw_scale  # type: ignore[assignment]  # the planted attribute or buffer
    return _floating(lambda t: t * scale, fwd(self, *args, **kwargs))


def _w_no_autocast(self: nn.Module, fwd: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch.autocast("cpu", enabled=False):
        return fwd(self, *args, **kwargs)


def _w_no_autocast_upcast(self: nn.Module, fwd: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch.autocast("cpu", enabled=False):
        return _w_upcast_inputs(self, fwd, args, kwargs)


class _Upcast(torch.autograd.Function):
    """A user's custom Function computing in float32 and not casting back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return x.float() * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(ctx.dtype)


def _w_custom_function(self: nn.Module, fwd: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _floating(lambda t: _Upcast.apply(t), fwd(self, *args, **kwargs))


def _w_index_put(self: nn.Module, fwd: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def clamp_positive(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        mask = t > 1.0
        t[mask] = t.detach()[mask].float() * 0.5  # the float32 source: a data-dependent index_put
        return t

    return _floating(clamp_positive, fwd(self, *args, **kwargs))


def _w_adapter(self: nn.Module, fwd: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = fwd(self, *args, **kwargs)
    adapter_a: nn.Module = self.cw_lora_a  # type: ignore[assignment]  # planted children
    adapter_b: nn.Module = self.cw_lora_b  # type: ignore[assignment]
    return out + adapter_b(adapter_a(args[0]))


WRAPPERS: dict[str, Callable[[nn.Module, Forward, tuple[Any, ...], dict[str, Any]], Any]] = {
    "upcast": _w_upcast_inputs,
    "factory": _w_factory,
    "scale": _w_scale_attr,
    "noautocast": _w_no_autocast,
    "noautocast_upcast": _w_no_autocast_upcast,
    "function": _w_custom_function,
    "index_put": _w_index_put,
    "adapter": _w_adapter,
}


def _grad_to_f32(grad: torch.Tensor) -> torch.Tensor:
    return grad.float()


def _output_to_f32(module: nn.Module, args: Any, output: Any) -> Any:
    return _floating(lambda t: t.float(), output)


def _output_grad_hook(module: nn.Module, args: Any, output: Any) -> None:
    def hook(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            t.register_hook(_grad_to_f32)  # type: ignore[no-untyped-call]
        return t

    _floating(hook, output)


# -- the fault classes ----------------------------------------------------------------------------


def _ANY(name: str, m: nn.Module) -> bool:
    return True


def _LEAF_WEIGHT(name: str, m: nn.Module) -> bool:
    return _own_weight(m)


def _TRAINABLE(name: str, m: nn.Module) -> bool:
    return any(p.is_floating_point() and p.requires_grad for p in m.parameters(recurse=False))


def _LINEAR(name: str, m: nn.Module) -> bool:
    return isinstance(m, nn.Linear)


_QKV = {
    "q_proj",
    "k_proj",
    "v_proj",
    "query",
    "key",
    "value",
    "q",
    "k",
    "v",
    "to_q",
    "to_k",
    "to_v",
    "q_lin",
    "k_lin",
    "v_lin",
    "wq",
    "wk",
    "wv",
    "q_linear",
    "k_linear",
    "v_linear",
}


def _with_params(name: str, m: nn.Module) -> bool:
    return any(p.is_floating_point() for p in m.parameters())


def stray_fp32_module(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _LEAF_WEIGHT)
    module.float()
    return _fault(name, "stray_fp32_module", f"`{name}` ({type(module).__name__}) cast to f32 by hand")


def f16_module_in_bf16(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _LEAF_WEIGHT)
    module.half()
    return _fault(name, "f16_module_in_bf16", f"`{name}` ({type(module).__name__}) cast to f16 in a bf16 model")


def float64_module(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _LEAF_WEIGHT)
    module.double()
    return _fault(name, "float64_module", f"`{name}` ({type(module).__name__}) left in f64")


def bias_left_fp32(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, lambda n, m: isinstance(getattr(m, "bias", None), nn.Parameter))
    bias: torch.Tensor = module.bias  # type: ignore[assignment]  # the predicate checked it is a Parameter
    module.bias = nn.Parameter(bias.detach().float())  # float32 source: the user's re-created bias
    return _fault(name, "bias_left_fp32", f"`{name}.bias` re-created in f32")


def fp32_island_no_castback(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _with_params)
    module.float()
    _swap_forward(module, "upcast")
    return _fault(name, "fp32_island_no_castback", f"`{name}` runs in f32 (inputs upcast), output not cast back")


def upcast_input_no_castback(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _with_params)
    _swap_forward(module, "upcast")
    return _fault(name, "upcast_input_no_castback", f"`{name}` upcasts its inputs to f32, weights unchanged")


def factory_in_forward(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _ANY)
    _swap_forward(module, "factory")
    return _fault(name, "factory_in_forward", f"`{name}` adds torch.zeros(...) (default dtype f32) made in forward")


def plain_tensor_attribute(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _ANY)
    module.cw_scale = torch.ones(1)  # a plain attribute: model.to() never casts it
    _swap_forward(module, "scale")
    return _fault(name, "plain_tensor_attribute", f"`{name}` scales its output by a plain f32 tensor attribute")


def buffer_left_fp32(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _ANY)
    module.register_buffer("cw_scale", torch.ones(1))
    _swap_forward(module, "scale")
    return _fault(name, "buffer_left_fp32", f"`{name}` scales its output by an f32 buffer registered after the cast")


def custom_function_upcast(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _ANY)
    _swap_forward(module, "function")
    return _fault(name, "custom_function_upcast", f"`{name}`'s output goes through a custom Function returning f32")


def autocast_disabled_region(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _with_params)
    _swap_forward(module, "noautocast")
    return _fault(name, "autocast_disabled_region", f"`{name}` runs under torch.autocast(enabled=False)")


def param_grad_hook(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _TRAINABLE)
    trainable = [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_floating_point() and p.requires_grad]
    if not trainable:  # a frozen parameter (an adapter's base layer) takes no hook
        raise NotApplicable(f"`{name}` has no trainable parameter")
    pname, param = rng.choice(trainable)
    param.register_hook(_grad_to_f32)  # type: ignore[no-untyped-call]
    return _fault(name, "param_grad_hook", f"a hook on `{name}.{pname}` returns the gradient in f32")


def output_grad_hook(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _ANY)
    module.register_forward_hook(_output_grad_hook)
    return _fault(name, "output_grad_hook", f"a tensor hook on `{name}`'s output returns its gradient in f32")


def output_hook_dtype(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _ANY)
    module.register_forward_hook(_output_to_f32)
    return _fault(name, "output_hook_dtype", f"a forward hook on `{name}` returns its output in f32")


def qkv_mismatch(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, lambda n, m: _LINEAR(n, m) and n.rsplit(".", 1)[-1].lower() in _QKV)
    module.float()
    _swap_forward(module, "noautocast_upcast")
    return _fault(name, "qkv_mismatch", f"attention projection `{name}` kept f32 (autocast off), output not cast back")


def shared_weight_changed(model: nn.Module, rng: random.Random) -> PlantedFault:
    owners: dict[int, list[str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None and p.is_floating_point():
                owners.setdefault(id(p), []).append(mname)
    shared = sorted(names for names in owners.values() if len(set(names)) > 1)
    modules = dict(model.named_modules(remove_duplicate=False))
    if not shared:  # tie two same-shaped linear layers, as weight tying does
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        pairs = [
            (a, b) for i, a in enumerate(linears) for b in linears[i + 1 :] if a[1].weight.shape == b[1].weight.shape
        ]
        if not pairs:
            raise NotApplicable("no shared or tieable weights")
        (a, ma), (b, mb) = rng.choice(pairs)
        mb.weight = ma.weight
        shared = [[a, b]]
    changed = rng.choice(sorted(set(rng.choice(shared))))
    modules[changed].float()
    return _fault(changed, "shared_weight_changed", f"`{changed}`, which shares a weight, cast to f32 by hand")


def adapter_other_dtype(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _LINEAR)
    assert isinstance(module, nn.Linear)  # the predicate picked a Linear
    module.cw_lora_a = nn.Linear(module.in_features, 4, bias=False)  # float32: added after the cast
    module.cw_lora_b = nn.Linear(4, module.out_features, bias=False)
    _swap_forward(module, "adapter")
    return _fault(name, "adapter_other_dtype", f"a hand-written f32 LoRA adapter on `{name}`")


def index_put_mismatch(model: nn.Module, rng: random.Random) -> PlantedFault:
    name, module = pick(model, rng, _ANY)
    _swap_forward(module, "index_put")
    return _fault(name, "index_put_mismatch", f"`{name}` writes an f32 tensor into its output through a mask")


_LOW = (*HAND_LOW, *TRUE)
FAULTS: dict[str, FaultClass] = {
    f.name: f
    for f in (
        FaultClass("stray_fp32_module", HAND_LOW, stray_fp32_module, "one module .float() in a hand-cast model"),
        FaultClass("f16_module_in_bf16", ("bf16-hand",), f16_module_in_bf16, "one module .half() in a bf16 model"),
        FaultClass("float64_module", ("32-true", "bf16-hand", *MIXED), float64_module, "one module left f64"),
        FaultClass("bias_left_fp32", HAND_LOW, bias_left_fp32, "a bias re-created in f32"),
        FaultClass("fp32_island_no_castback", HAND_LOW, fp32_island_no_castback, "f32 island, no cast back"),
        FaultClass("upcast_input_no_castback", _LOW, upcast_input_no_castback, "inputs upcast in forward"),
        FaultClass("factory_in_forward", (*_LOW, *MIXED), factory_in_forward, "default-dtype tensor made in forward"),
        FaultClass("plain_tensor_attribute", (*_LOW, *MIXED), plain_tensor_attribute, "plain f32 tensor attribute"),
        FaultClass("buffer_left_fp32", _LOW, buffer_left_fp32, "a buffer left f32"),
        FaultClass("custom_function_upcast", _LOW, custom_function_upcast, "custom autograd.Function returning f32"),
        FaultClass("autocast_disabled_region", MIXED, autocast_disabled_region, "autocast disabled in one module"),
        FaultClass("param_grad_hook", _LOW, param_grad_hook, "a parameter hook changing the gradient's dtype"),
        FaultClass("output_grad_hook", (*_LOW, *MIXED), output_grad_hook, "an activation hook changing grad dtype"),
        FaultClass("output_hook_dtype", _LOW, output_hook_dtype, "a forward hook returning f32"),
        FaultClass("qkv_mismatch", (*HAND_LOW, *MIXED), qkv_mismatch, "one of q/k/v kept f32"),
        FaultClass("shared_weight_changed", HAND_LOW, shared_weight_changed, "a tied weight changed through one owner"),
        FaultClass("adapter_other_dtype", HAND_LOW, adapter_other_dtype, "an adapter in another dtype"),
        FaultClass("index_put_mismatch", _LOW, index_put_mismatch, "a masked write of an f32 tensor"),
    )
}
