"""``apply(model, policy)``: make ``model(...)`` run under a precision policy, reversibly.

In place, like torchao's ``quantize_``: parameters and buffers are cast per the policy's rules
(``Parameter`` objects keep their identity, so optimizers and tied weights stay valid), fp32
islands cast their floating inputs in and their outputs back to the dtype around them (the
compute dtype, or an enclosing island's), the model's inputs are cast, autocast is entered
for mixed policies, and torch's default dtype is set while the model runs where the policy says
(``default_dtype``, as Lightning's ``*-true`` do). State-dict keys do not change. ``Applied.remove()`` (or leaving
``with apply(...)``) restores the model exactly: every tensor nobody wrote to gets its original
bits back; one that was written to meanwhile (training, running stats) keeps its new values,
cast back to its original dtype.

Mechanism: the root and each island get an instance attribute ``forward``, a method bound to
the module that wraps the class's forward (bound, so ``copy.deepcopy(model)`` rebinds it to the
copy). That adds no hooks and no torch-function overrides, which would change the code path
some modules take (TransformerEncoderLayer's fast path checks for both).
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from castwise import _autocast, _dtypes, devices
from castwise._compiled import uncompiled
from castwise._dtypes import short_of
from castwise.applied.inspection import Decision, _user_stacklevel, resolve, unmatched_rules, warn_unmatched
from castwise.errors import ApplyError
from castwise.float8.convert import Float8Conversion, Float8Plan
from castwise.float8.convert import convert as float8_convert
from castwise.policy import Policy

__all__ = ["Applied", "Decision", "applied_to", "apply", "cast_floating", "iter_casts", "resolve", "unmatched_rules"]

_FLOAT_DTYPES = tuple(_dtypes.to_torch(name) for name in _dtypes.POLICY_DTYPES)
_SHORT_NAMES = ", ".join(sorted(_dtypes.short(name) for name in _dtypes.POLICY_DTYPES))
_F16_MAX = torch.finfo(torch.float16).max
# modules whose fused fast path reads submodule weights directly, bypassing island wrappers
_FASTPATH_MODULES = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.MultiheadAttention)

# model -> its Applied, weakly both ways: the Applied is kept alive by the model's root forward
# wrapper (and by the user's handle), so an applied model that nobody holds can be collected
_APPLIED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Applied]] = weakref.WeakKeyDictionary()
# module classes that hold packed, quantised weights outside parameters (torch.ao)
_QUANTISED_MODULE_PACKAGES = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized")


# -- casting nested outputs ------------------------------------------------------------------


def _saturate(t: torch.Tensor) -> torch.Tensor:
    # overflow is why the layer was kept in float32: clamp to float16's finite range, not inf
    return t.clamp(-_F16_MAX, _F16_MAX) if t.dtype in (torch.float32, torch.float64) else t


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype, saturate: bool) -> torch.Tensor:
    if not t.is_floating_point() or t.dtype == dtype:
        return t
    if saturate and dtype == torch.float16:
        t = _saturate(t)
    return t.to(dtype)


def _tree_map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, obj)


def cast_floating(obj: Any, dtype: torch.dtype, saturate: bool = False) -> Any:
    """Every floating tensor in a nested structure cast, rebuilt by torch's pytree (tuples, lists,
    dicts, namedtuples, ModelOutputs: new containers of the same type; the caller's are never mutated)."""
    return _tree_map(obj, lambda t: _cast_tensor(t, dtype, saturate))


def saturated(obj: Any) -> Any:
    """Every float32/float64 tensor in a nested structure clamped to float16's finite range: what
    an island kept in float32 for an f16 overflow returns, the largest f16 instead of inf."""
    return _tree_map(obj, _saturate)


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def _lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Lossless casts can be undone by casting back; others keep the original tensor for remove()."""
    return _dtypes.widens(_dtypes.name_of(src), _dtypes.name_of(dst))


def _first_device(args: tuple[Any, ...], kwargs: dict[str, Any], default: str) -> str:
    """The device type of the first tensor argument (cheap: top level only), else ``default``."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return default


# -- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorRecord:
    module: nn.Module
    name: str  # attribute name in module._parameters / _buffers
    kind: str  # "param" | "buffer"
    original: torch.Tensor | None  # kept when the cast is lossy
    original_dtype: torch.dtype
    original_grad: torch.Tensor | None
    cast: torch.Tensor | None = None  # the buffer apply stored (buffers are replaced, not re-pointed)
    cast_dtype: torch.dtype | None = None
    version: int = 0  # the tensor's version counter right after the cast

    def changed(self, current: torch.Tensor) -> bool:
        """Whether ``current`` was written to (trained, updated in place) or replaced since apply.
        Version counters miss some writes (batch_norm updates running stats without bumping
        them), so unless they already tell, the values are compared with the cast original."""
        if self.kind == "buffer" and current is not self.cast:
            return True
        if current.dtype != self.cast_dtype or current._version != self.version:
            return True
        if self.original is None or _is_fake(current) or current.device.type == "meta":
            return False
        return not torch.equal(current.detach(), self.original.to(current.dtype))


@dataclass(frozen=True)
class _ForwardRecord:
    module: nn.Module
    had_instance_forward: bool
    previous: Any


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def _applied_on(module: nn.Module) -> Applied | None:
    ref = _APPLIED.get(module)
    return ref() if ref is not None else None


def _check_manageable(model: nn.Module, casts: bool = True) -> None:
    """Refuse models whose dtypes castwise cannot manage, before changing anything.
    ``casts=False``: the policy casts no tensor (a mixed policy without islands), so quantised
    weights are left alone rather than refused."""
    if not isinstance(model, nn.Module):
        raise ApplyError(f"apply needs a torch.nn.Module, got {type(model).__name__}")
    for name, module in model.named_modules():
        other = _applied_on(module)
        if other is not None:
            where = type(model).__name__ if not name else f"its submodule {name!r}"
            raise ApplyError(
                f"{where} is already under castwise policy {other.policy}; call .remove() on the "
                "first apply() before applying another policy"
            )
        quantised = type(module).__module__.startswith(_QUANTISED_MODULE_PACKAGES) or hasattr(module, "_packed_params")
        if casts and quantised:
            raise ApplyError(
                f"module {name or '(root)'!r} is a quantised {type(module).__module__}.{type(module).__name__} "
                "(packed int8 weights): "
                "castwise will not half-convert a quantised model; apply the policy before quantising"
            )
    for ref in list(_APPLIED.values()):
        other = ref()
        if other is not None and any(m is model for m in other.model.modules()):
            raise ApplyError(
                f"{type(model).__name__} is inside a {type(other.model).__name__} that is already under "
                f"castwise policy {other.policy}; call .remove() on that apply() first"
            )
    for name, p in model.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ApplyError(
                f"parameter {name!r} is not initialized (a lazy module): run one forward pass "
                "first so its shape and dtype exist, then apply"
            )
        if not casts:
            continue
        # fake parameters (FakeTensorMode) are FakeTensors flagged as parameters, not Parameters
        plain = type(p) is nn.Parameter or (_is_fake(p) and isinstance(p, nn.Parameter))
        if not plain or not (type(p.data) is torch.Tensor or _is_fake(p.data)):
            raise ApplyError(
                f"parameter {name!r} is a {type(p).__name__} holding {type(p.data).__name__}: quantised or "
                "sharded parameters (bitsandbytes, torchao, DTensor) keep their own dtypes, and castwise "
                "will not half-convert such a model; apply the policy before quantising or sharding"
            )
        if p.is_quantized or (not p.is_floating_point() and not p.is_complex()):
            raise ApplyError(
                f"parameter {name!r} is {short_of(p.dtype)}: a quantised weight castwise cannot cast "
                f"without destroying it; valid parameter dtypes: {_SHORT_NAMES}"
            )
        if p.is_floating_point() and p.dtype not in _FLOAT_DTYPES:
            raise ApplyError(
                f"parameter {name!r} is {short_of(p.dtype)} (a float8 / quantised format); castwise "
                "manages bf16, f16, f32 and f64 models only"
            )
    for name, b in model.named_buffers():
        if casts and b.is_quantized:
            raise ApplyError(
                f"buffer {name!r} is a quantised {short_of(b.dtype)} tensor: castwise will not half-convert "
                "a quantised model; apply the policy before quantising"
            )


def _owner_dtypes(model: nn.Module, policy: Policy, decisions: dict[str, Decision]) -> dict[str, torch.dtype | None]:
    """For every module, the island dtype it sits in (None: not in an island)."""
    out: dict[str, torch.dtype | None] = {}
    for name, _ in model.named_modules():
        island: torch.dtype | None = None
        parts = name.split(".") if name else []
        # the innermost enclosing island wins (a rule on an inner module applies to it)
        for i in range(len(parts), -1, -1):
            d = decisions.get(".".join(parts[:i]))
            if d is not None and d.island is not None:
                island = d.island
                break
        out[name] = island
    return out


def _device_type(model: nn.Module) -> str:
    for t in (*model.parameters(), *model.buffers()):
        return t.device.type
    return "cpu"


class Applied:
    """A policy applied to a model; ``remove()`` (or the ``with`` block's end) undoes it."""

    def __init__(self, model: nn.Module, policy: Policy, decisions: dict[str, Decision]) -> None:
        self.model = model
        self.policy = policy
        self.decisions = decisions
        self.fastpath_off = not policy.fastpath
        self._tensors: list[_TensorRecord] = []
        self._forwards: list[_ForwardRecord] = []
        self._removed = False
        self.float8_conversion: Float8Conversion | None = None  # set by apply for fp8=... policies
        # where the model lives, for autocast when a call passes no tensor (read once: scanning
        # every parameter on each call was the wrappers' main cost)
        self._device = _device_type(model)

    # -- what it did ------------------------------------------------------------------------

    @property
    def islands(self) -> dict[str, torch.dtype]:
        """Qualified names of the modules that run as islands, with their dtype."""
        return {n: d.island for n, d in self.decisions.items() if d.island is not None}

    @property
    def float8(self) -> Float8Plan | None:
        """The Linears a float8 policy converted and those it left out, with why (None: no fp8)."""
        return self.float8_conversion.plan if self.float8_conversion is not None else None

    def __repr__(self) -> str:
        f8 = f", float8={len(self.float8.converted)}" if self.float8 is not None else ""
        return (
            f"Applied(policy={str(self.policy)!r}, islands={len(self.islands)}, "
            f"casts={len(self._tensors)}{f8}, removed={self._removed})"
        )

    # -- undo --------------------------------------------------------------------------------

    def remove(self) -> None:
        """Restore the model exactly: forwards, parameter and buffer values and dtypes, grads.

        A tensor nobody wrote to since ``apply`` gets its original back, bit for bit. One that
        was written to (trained, a BatchNorm's running stats) keeps its new values, cast back to
        its original dtype, so undoing the policy does not undo training."""
        if self._removed:
            return
        for rec in reversed(self._forwards):
            if rec.had_instance_forward:
                rec.module.forward = rec.previous  # type: ignore[method-assign]
            else:
                rec.module.__dict__.pop("forward", None)
        for t in reversed(self._tensors):
            store = t.module._parameters if t.kind == "param" else t.module._buffers
            current = store[t.name]
            if current is None:
                continue
            if t.original is not None and not t.changed(current):
                restored = t.original
            else:
                restored = current.data.to(t.original_dtype)
            if t.kind == "param":
                current.data = restored
                current.grad = t.original_grad
            else:
                store[t.name] = restored  # type: ignore[assignment]
        if self.float8_conversion is not None:
            self.float8_conversion.undo()
        _APPLIED.pop(self.model, None)
        self._removed = True

    def __enter__(self) -> Applied:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- doing -------------------------------------------------------------------------------

    def _cast_tensors(self, owner_dtypes: dict[str, torch.dtype | None]) -> None:
        seen: set[int] = set()
        policy = self.policy
        if policy.converted:
            return  # the framework's own conversion already ran: what it left is what runs
        # mixed policies leave the model's tensors as they are and let autocast cast at each op,
        # as Lightning's and Accelerate's mixed precision do; only islands (and an explicit
        # buffers= clause) cast tensors. True policies store everything in the policy's dtypes.
        default_param = None if policy.is_mixed else policy.param_dtype
        default_buffer = policy.buffer_dtype if policy.is_mixed else policy.effective_buffer_dtype
        # module.to(dtype) casts complex tensors too (the real part kept): policies that model it say so
        castable = (lambda t: t.is_floating_point() or t.is_complex()) if policy.cast_complex else _is_float
        for mname, module in self.model.named_modules():
            island = owner_dtypes[mname]
            for pname, p in list(module._parameters.items()):
                if p is None or id(p) in seen or not castable(p):
                    continue
                seen.add(id(p))  # tied weights: cast once, by their first owner
                target = island or default_param
                if target is None or p.dtype == target:
                    continue
                lossless = _lossless(p.dtype, target)
                grad = p.grad
                original, original_dtype = p.data, p.dtype
                p.data = p.data.to(target)
                if grad is not None:
                    p.grad = grad.to(target)
                self._tensors.append(
                    _TensorRecord(
                        module,
                        pname,
                        "param",
                        None if lossless else original,
                        original_dtype,
                        grad,
                        None,
                        target,
                        p._version,
                    )
                )
            for bname, b in list(module._buffers.items()):
                if b is None or id(b) in seen or not castable(b):
                    continue
                seen.add(id(b))
                target = island or (None if policy.keeps_buffer(module, bname) else default_buffer)
                if target is None or b.dtype == target:
                    continue
                lossless = _lossless(b.dtype, target)
                cast = b.to(target)
                module._buffers[bname] = cast
                self._tensors.append(
                    _TensorRecord(
                        module, bname, "buffer", None if lossless else b, b.dtype, None, cast, target, cast._version
                    )
                )

    def _wrap(self, module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
        had = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        # wrappers take the module as their first argument and are bound to it, so that
        # copy.deepcopy(model) (EMA copies) rebinds them to the copy instead of running the original
        inner: Callable[..., Any]
        if not had:
            inner = type(module).forward
        elif isinstance(previous, types.MethodType) and previous.__self__ is module:
            inner = previous.__func__
        else:  # someone else's plain function in the instance dict: call it as it is

            def inner(_module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return previous(*args, **kwargs)  # type: ignore[misc]

        wrapped = make(inner)
        # __wrapped__ lets inspect.signature(model.forward) see the real parameters (transformers reads them)
        original: Any = previous.__func__ if isinstance(previous, types.MethodType) else previous
        functools.update_wrapper(wrapped, original if had else type(module).forward)
        self._forwards.append(_ForwardRecord(module, had, previous))
        module.forward = types.MethodType(wrapped, module)  # type: ignore[method-assign]
        return wrapped

    def _install_forwards(self, owner_dtypes: dict[str, torch.dtype | None]) -> None:
        policy = self.policy
        modules = dict(self.model.named_modules())
        device = self._device
        compute = policy.compute_dtype
        saturate = policy.cast_back == "saturate"
        for name, d in sorted(self.decisions.items(), key=lambda kv: -kv[0].count(".") if kv[0] else 1):
            module = modules[name]
            if d.island is not None:
                # an island's output goes back to the dtype around it: the enclosing island's, or compute
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                back = (owner_dtypes.get(parent) if name else None) or compute
                self._wrap(module, _island_forward(d.island, back, saturate, device))
            if d.output is not None:
                self._wrap(module, _output_forward(d.output))
            if _inside_fastpath_module(name, modules):
                # a fused fast path would read the island's weights directly and skip its casts
                self.fastpath_off = True
        root = self._wrap(self.model, _root_forward(policy, device, lambda: self.fastpath_off))
        root.__castwise_applied__ = self  # type: ignore[attr-defined]  # lives as long as the wrapper


def _inside_fastpath_module(name: str, modules: dict[str, nn.Module]) -> bool:
    parts = name.split(".") if name else []
    return any(isinstance(modules.get(".".join(parts[:i])), _FASTPATH_MODULES) for i in range(len(parts) + 1))


def _island_forward(
    dtype: torch.dtype, back: torch.dtype, saturate: bool, device: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            args, kwargs = cast_floating((args, kwargs), dtype)
            where = _first_device(args, kwargs, device)
            if where != "meta" and torch.is_autocast_enabled(where):
                with _autocast.autocast(where, None, enabled=False):  # the island runs in its dtype
                    out = inner(module, *args, **kwargs)
            else:
                out = inner(module, *args, **kwargs)
            return cast_floating(out, back, saturate=saturate)

        return forward

    return make


def _output_forward(dtype: torch.dtype) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return cast_floating(inner(module, *args, **kwargs), dtype)

        return forward

    return make


def _root_forward(
    policy: Policy, device: str, fastpath_off: Callable[[], bool]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if policy.input_dtype is not None:
                args, kwargs = cast_floating((args, kwargs), policy.input_dtype)
            where = _first_device(args, kwargs, device) if policy.is_mixed else "meta"
            plain = not fastpath_off() and policy.default_dtype is None
            if where != "meta" and plain and torch.compiler.is_compiling():
                # torch's own block: Dynamo keeps it as a region of the graph and resumes in it after a
                # graph break inside; in another block it skips the frame, for good (this forward's
                # code object is every applied model's)
                with torch.autocast(where, dtype=policy.compute_dtype):
                    return cast_floating(inner(module, *args, **kwargs), policy.output_dtype)
            with ExitStack() as stack:
                if where != "meta":  # autocast has no meta backend (meta tensors carry shapes only)
                    stack.enter_context(_autocast.autocast(where, policy.compute_dtype))
                if fastpath_off():
                    stack.enter_context(_fastpath_disabled())
                if policy.default_dtype is not None:
                    stack.enter_context(_default_dtype(policy.default_dtype))
                out = inner(module, *args, **kwargs)
            return cast_floating(out, policy.output_dtype)

        return forward

    return make


class _fastpath_disabled:
    def __enter__(self) -> None:
        self.before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch.backends.mha.set_fastpath_enabled(self.before)


class _default_dtype:
    """torch's default dtype set while the model runs (Lightning's *-true forward_context), and
    restored after, whatever happened inside."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        self.before = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.before)


def apply(model: nn.Module, policy: Policy | str, *, device: str | devices.Device | None = None) -> Applied:
    """Make ``model(...)`` run under ``policy``, in place; returns an ``Applied`` to undo it.

    >>> applied = castwise.apply(model, "bf16-true")   # or a castwise.Policy
    >>> model(x)                                        # bf16, norms as fp32 islands
    >>> applied.remove()                                # the model as it was, bit for bit

    A policy with a float8 recipe (``"fp8"``, ``"fp8,fp8=rowwise"``, ``"mxfp8"``) also converts
    the Linears castwise's filter picks to torchao's float8 training layers (emulated on CPU);
    ``applied.float8`` lists the converted and the left-out layers with why
    (``castwise.float8.convert``). ``device``: the GPU class those float8 GEMMs are for (its float8
    flavour: ``cuda:mi300x`` takes e4m3fnuz / e5m2fnuz); None: the GPU the model is on.
    """
    policy = Policy.parse(policy)
    target = devices.get(device) if device is not None else None
    if not isinstance(model, nn.Module):
        raise ApplyError(f"apply needs a torch.nn.Module, got {type(model).__name__}")
    # a torch.compile'd model: the module it compiled, whose names the policy's selectors use
    # (Dynamo traces the forwards installed on it, before or after the compile)
    model = uncompiled(model)
    decisions = resolve(policy, model)  # raises on ambiguous rules, before anything changes
    casts = not policy.is_mixed or policy.buffer_dtype is not None or any(d.island for d in decisions.values())
    _check_manageable(model, casts)
    warn_unmatched(policy, model)
    # float8 first: the layers it swaps are the ones the base policy's wrappers then see
    conversion = float8_convert(model, policy.float8, decisions, target) if policy.float8 is not None else None
    if conversion is not None and (idle := conversion.plan.none_converted()):
        warnings.warn(idle, UserWarning, stacklevel=_user_stacklevel())  # a float8 policy doing nothing is said
    applied = Applied(model, policy, decisions)
    applied.float8_conversion = conversion
    owner = _owner_dtypes(model, policy, decisions)
    try:
        applied._cast_tensors(owner)
        applied._install_forwards(owner)
    except BaseException:
        applied.remove()
        raise
    _APPLIED[model] = weakref.ref(applied)
    return applied


def applied_to(model: nn.Module) -> Applied | None:
    """The ``Applied`` currently on ``model`` (or on what its torch.compile wraps), if any."""
    return _applied_on(uncompiled(model))


def iter_casts(applied: Applied) -> Iterator[tuple[str, str, torch.dtype]]:
    """(module name, tensor name, original dtype) of every tensor apply cast."""
    names = {id(m): n for n, m in applied.model.named_modules()}
    for t in applied._tensors:
        yield names.get(id(t.module), "?"), t.name, t.original_dtype
