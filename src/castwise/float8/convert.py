"""FP8 as part of ``apply``: which Linears a float8 recipe converts, converting them, undoing it.

A policy with ``fp8=...`` converts the model's ``nn.Linear`` layers to torchao's float8 training
layers (``Float8Linear`` for tensorwise and rowwise, ``MXFP8TrainingOpConfig`` for mxfp8),
emulated where the model lives on the CPU (float8 rounding, the matmul in high precision), with
float8 kernels (``torch._scaled_mm``) on CUDA.

Castwise's one filter (``reasons``; ``leave_out`` its first; forecast's leave-out list, CW313,
reads it too) leaves a Linear out where a policy island holds it (``keep[...]``); its dimensions
are not multiples of 16 (32 for MX blocks: ``torch._scaled_mm`` refuses them); it is the output
head (``get_output_embeddings()``, or named as torchtitan's default ``filter_fqns``) or its weight
is tied to another module's (the logits' rounding goes straight into the loss); it is tiny (under
1024 weights: scaling costs more than the GEMM saves); it is not an ``nn.Linear``, or a subclass
that overrides ``forward`` (torchao converts subclasses: its ``Float8Linear`` would drop that math,
its MX weight runs an MX GEMM only where that forward calls ``F.linear``), or nn.MultiheadAttention's
``out_proj``; or, for mxfp8, it has a bias that the installed torchao's MX layer drops
(``mx_drops_bias``, measured).

Undo is exact: the original ``nn.Linear`` objects go back into their parents. Float8Linear
holds the very ``Parameter`` objects of the layer it replaced, so a step trained meanwhile
stays trained, and optimizers keep their parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from castwise import devices
from castwise.errors import ApplyError
from castwise.float8.scaling import RECIPES, multiple
from castwise.policy.float8 import Float8Recipe

__all__ = ["Float8Conversion", "Float8Plan", "convert", "leave_out", "plan", "reasons"]

TINY = 1024  # weight elements under which a Linear is left out
HEAD_NAMES = ("lm_head", "output", "head", "classifier")


class Decision(Protocol):
    """What the policy decided for a module (``applied.inspection.Decision``): its island dtype."""

    @property
    def island(self) -> torch.dtype | None: ...


def mx_training(model: nn.Module, emulate: bool, chosen: Callable[[nn.Module, str], bool]) -> None:
    """torchao's MXFP8 training layers in place of ``model``'s Linears (``chosen``: which); emulated
    (``KernelPreference.EMULATED``) or its kernels. ImportError without torchao's MX training."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    kernel = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
    quantize_(model, MXFP8TrainingOpConfig(kernel_preference=kernel), filter_fn=chosen)


@functools.cache
def mx_drops_bias() -> bool:
    """Whether the installed torchao's MXFP8 training linear leaves the bias out of its output,
    measured once on a tiny emulated layer (zero weight, bias 1: the output must be the bias)."""
    from torch.utils._python_dispatch import _disable_current_modes

    # measured on real CPU tensors even when first asked inside a fake-tensor audit (its modes off)
    with _disable_current_modes():
        layer = nn.Linear(32, 32, device="cpu")
        with torch.no_grad():
            layer.weight.zero_()
            layer.bias.fill_(1.0)
        probe = nn.Sequential(layer)
        try:
            mx_training(probe, True, lambda m, _: isinstance(m, nn.Linear))
        except ImportError:
            return False  # no MX training to convert with: apply refuses the recipe itself
        with torch.no_grad():
            out = probe(torch.zeros(32, 32, device="cpu"))
        return not bool(torch.allclose(out, torch.ones_like(out)))


MX_BIAS = "it has a bias, which the installed torchao's MXFP8 training linear drops from its output (measured)"


@dataclass(frozen=True)
class Float8Plan:
    """Which Linears a float8 recipe converts, and which it leaves out with the reason."""

    recipe: Float8Recipe
    converted: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...]  # (qualified name, why)

    def table(self) -> str:
        """One line per layer: converted, or left out and why."""
        width = max((len(n) for n in (*self.converted, *(n for n, _ in self.left_out))), default=0)
        rows = [f"{n:<{width}}  float8 ({self.recipe})" for n in self.converted]
        rows += [f"{n:<{width}}  left out: {why}" for n, why in self.left_out]
        return "\n".join(rows)

    def none_converted(self) -> str | None:
        """What apply warns when the recipe converts no Linear (None: it converts some)."""
        why = f"each is left out:\n{self.table()}" if self.left_out else "the model has no nn.Linear"
        return None if self.converted else f"castwise: fp8={self.recipe} converts no Linear; {why}"


def _shared(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> the first module that holds it, for parameters two modules hold."""
    first: dict[int, str] = {}
    shared: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is None:
                continue
            if id(p) in first and first[id(p)] != name:
                shared[id(p)] = first[id(p)]
            first.setdefault(id(p), name)
    return shared


def _head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except Exception:  # a model whose accessor needs a config it lacks
            return None
        return head if isinstance(head, nn.Module) else None
    return None


def _island(name: str, decisions: Mapping[str, Decision]) -> tuple[str, torch.dtype] | None:
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        owner = ".".join(parts[:i])
        d = decisions.get(owner)
        if d is not None and d.island is not None:
            return owner, d.island
    return None


def _reasons(
    name: str,
    module: nn.Module,
    recipe: Float8Recipe,
    head: nn.Module | None,
    shared: dict[int, str],
    decisions: Mapping[str, Decision],
) -> list[str]:
    """Every reason castwise's filter leaves this Linear out of float8, the first the strongest."""
    if not name:
        return ["the model itself: apply converts layers inside a model, in place"]
    if not isinstance(module, nn.Linear):
        return [f"a {type(module).__name__}, not an nn.Linear: torchao converts nn.Linear (and subclasses) only"]
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return ["nn.MultiheadAttention's out_proj: the attention multiplies by its weight itself, not by its forward"]
    if type(module).forward is not nn.Linear.forward:
        # MX swaps the weight only: FalconLinear's `x @ w.T` unwraps it (measured), F.linear does not
        lost = (
            "MX weight runs an MX GEMM only in F.linear, which that forward may not call"
            if recipe.scaling == "mxfp8"
            else "Float8Linear would replace it"
        )
        return [f"a {type(module).__name__} that overrides forward: torchao's {lost}"]
    island = _island(name, decisions)
    if island is not None:
        owner, dtype = island
        return [f"kept in {str(dtype).removeprefix('torch.')} by the policy's keep[{owner}] island"]
    why: list[str] = []
    n = multiple(recipe)
    out_f, in_f = module.weight.shape
    if in_f % n or out_f % n:
        why.append(f"its dimensions ({in_f}, {out_f}) are not multiples of {n}: torch._scaled_mm refuses them")
    if module is head or name.rsplit(".", 1)[-1] in HEAD_NAMES:
        why.append("the output head: the logits' float8 rounding goes straight into the loss")
    holder = shared.get(id(module.weight))
    if holder is not None:
        why.append(f"its weight is tied to {holder}'s (tied embeddings)")
    if module.weight.numel() < TINY:
        why.append(f"tiny ({in_f}x{out_f}, under {TINY} weights): scaling costs more than the GEMM saves")
    if recipe.scaling == "mxfp8" and module.bias is not None and mx_drops_bias():
        why.append(MX_BIAS)
    return why


def leave_out(name: str, module: nn.Module, recipe: Float8Recipe) -> str | None:
    """Why castwise leaves this Linear (seen alone: no head, no tied weights) out, or None."""
    why = _reasons(name, module, recipe, None, {}, {})
    return why[0] if why else None


def reasons(model: nn.Module, recipe: Float8Recipe, decisions: Mapping[str, Decision]) -> dict[str, list[str]]:
    """The filter over ``model``: each Linear (and transformers' Conv1D) with every reason it is
    left out (empty: converted). apply's plan and forecast's leave-out list (CW313) both read it."""
    head, shared = _head(model), _shared(model)
    return {
        name: _reasons(name, module, recipe, head, shared, decisions)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
    }


def plan(model: nn.Module, recipe: Float8Recipe, decisions: Mapping[str, Decision]) -> Float8Plan:
    """The layers ``recipe`` converts in ``model`` and those it leaves out (with the reason)."""
    found = reasons(model, recipe, decisions)
    converted = tuple(name for name, why in found.items() if not why)
    return Float8Plan(recipe, converted, tuple((name, why[0]) for name, why in found.items() if why))


# -- converting ------------------------------------------------------------------------------


def _torchao() -> Any:
    try:
        import torchao.float8 as ao_float8
    except ImportError as exc:
        raise ApplyError(
            "a float8 policy converts Linears with torchao, which is not installed: pip install torchao "
            "(or apply the base policy and measure float8 with castwise.compare, which emulates it)"
        ) from exc
    return ao_float8


# the float8 flavour each class's GEMMs take (devices.LowPrecision.fp8): OCP e4m3fn/e5m2, or on
# MI300 (gfx942) the FNUZ pair, as torchao.float8.config.e4m3_dtype picks by torchao.utils.is_MI300
_FNUZ = {"float8_e4m3fn": "float8_e4m3fnuz", "float8_e5m2": "float8_e5m2fnuz"}
_MI300_ARCHS = ("gfx940", "gfx941", "gfx942")  # torchao.utils.is_MI300


def fnuz(target: devices.Device | None, where: str) -> bool:
    """Whether float8 GEMMs for ``target`` (None: the GPU the model is on, as torch reports it)
    take the FNUZ flavour: the class's own float8 dtypes say so (cuda:mi300x)."""
    if target is not None:
        fp8 = target.low_precision().fp8
        return bool(fp8) and all(d.endswith("fnuz") for d in fp8)
    if where != "cuda" or not torch.cuda.is_available():
        return False
    arch = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "gcnArchName", ""))
    return any(a in arch for a in _MI300_ARCHS)


def _float8_config(recipe: Float8Recipe, emulate: bool, flavour_fnuz: bool = False) -> Any:
    ao = _torchao()

    def dtype(name: str) -> torch.dtype:
        return getattr(torch, _FNUZ.get(name, name) if flavour_fnuz else name)  # type: ignore[no-any-return]

    if recipe.scaling == "rowwise":
        if recipe.format != "e4m3":
            raise ApplyError(f"fp8=rowwise:{recipe.format}: torchao's rowwise recipe is e4m3 only; valid: fp8=rowwise")
        config = ao.Float8LinearConfig.from_recipe_name("rowwise")
        casts = {  # every cast the recipe makes (its grad-weight ones too), in the class's flavour
            f.name: dataclasses.replace(cast, target_dtype=dtype(str(cast.target_dtype)[6:]))
            for f in dataclasses.fields(config)
            if f.name.startswith("cast_config_")
            and (cast := getattr(config, f.name)) is not None
            and getattr(cast, "target_dtype", None) is not None
        }
        return dataclasses.replace(config, emulate=emulate, **casts)
    forward = dtype(recipe.forward_dtype)
    grad = dtype(recipe.gradient_dtype)
    return ao.Float8LinearConfig(
        cast_config_input=ao.CastConfig(target_dtype=forward),
        cast_config_weight=ao.CastConfig(target_dtype=forward),
        cast_config_grad_output=ao.CastConfig(target_dtype=grad),
        emulate=emulate,
    )


@dataclass
class Float8Conversion:
    """A conversion done: its plan, and what undoes it."""

    plan: Float8Plan
    emulated: bool
    _modules: list[tuple[nn.Module, str, nn.Module]] = dataclasses.field(default_factory=list)
    _params: list[tuple[nn.Module, str, nn.Parameter]] = dataclasses.field(default_factory=list)
    _forwards: list[nn.Module] = dataclasses.field(default_factory=list)

    def undo(self) -> None:
        """The original Linears and Parameters back where they were (values trained meanwhile kept)."""
        for parent, attr, original in reversed(self._modules):
            setattr(parent, attr, original)
        for module in self._forwards:
            module.__dict__.pop("forward", None)
        for module, pname, param in reversed(self._params):
            module._parameters[pname] = param  # the wrapper shared its storage: trained values kept
        self._modules.clear()
        self._params.clear()
        self._forwards.clear()


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    head, _, attr = name.rpartition(".")
    return (model.get_submodule(head) if head else model), attr


def _swap_linears(model: nn.Module, conv: Float8Conversion, make: Callable[[nn.Module], nn.Module]) -> None:
    for name in conv.plan.converted:
        parent, attr = _parent(model, name)
        original = getattr(parent, attr)
        setattr(parent, attr, make(original))
        conv._modules.append((parent, attr, original))


def _mxfp8(model: nn.Module, conv: Float8Conversion) -> None:
    chosen = set(conv.plan.converted)
    for name in conv.plan.converted:
        module = model.get_submodule(name)
        conv._params += [(module, n, p) for n, p in module._parameters.items() if p is not None]
    # torchao's MX casts on CUDA are triton kernels: without a GPU triton can use (a CPU-only machine
    # auditing a simulated GPU) the emulated path runs, with the same shapes and dtypes
    from torch.utils._triton import has_triton

    fake = any(type(p).__name__ == "FakeTensor" or type(p.data).__name__ == "FakeTensor" for p in model.parameters())
    try:
        mx_training(model, conv.emulated or fake or not has_triton(), lambda _m, fqn: fqn in chosen)
    except ImportError as exc:
        raise ApplyError("fp8=mxfp8 needs torchao's MXFP8 training (torchao >= 0.15): pip install -U torchao") from exc
    if conv.emulated:
        # torchao's emulated MX GEMM dequantizes both operands to their own dtypes and refuses a
        # bf16 activation (autocast) against a float32 weight: run it in the weight's dtype
        for name in conv.plan.converted:
            module = model.get_submodule(name)
            module.forward = types.MethodType(_weight_dtype_forward, module)  # type: ignore[method-assign]
            conv._forwards.append(module)


def _fp4(model: nn.Module, conv: Float8Conversion) -> None:
    """NVFP4 / MXFP4 Linears: torchao's NVFP4 training layers on a real CUDA model where torchao has
    them, else castwise's bit-exact emulation (``emulate``: E2M1 blocks, straight-through gradients)."""
    recipe = conv.plan.recipe
    fake = any(type(p).__name__ == "FakeTensor" for p in model.parameters())
    if recipe.scaling == "nvfp4" and not conv.emulated and not fake:
        try:
            from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig
            from torchao.quantization import quantize_
        except ImportError:
            pass
        else:
            chosen = set(conv.plan.converted)
            for name in chosen:
                module = model.get_submodule(name)
                conv._params += [(module, n, p) for n, p in module._parameters.items() if p is not None]
            quantize_(model, NVFP4TrainingConfig(), filter_fn=lambda _m, fqn: fqn in chosen)
            return
    conv.emulated = True
    from castwise.float8 import emulate

    for name in conv.plan.converted:
        module = model.get_submodule(name)
        module.forward = types.MethodType(emulate.linear_forward(recipe), module)  # type: ignore[method-assign]
        conv._forwards.append(module)


def _weight_dtype_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    where = x.device.type
    with torch.autocast(where, enabled=False):
        out: torch.Tensor = nn.Linear.forward(module, x.to(module.weight.dtype))
    return out.to(x.dtype)


def convert(
    model: nn.Module,
    recipe: Float8Recipe,
    decisions: Mapping[str, Decision],
    target: devices.Device | None = None,
) -> Float8Conversion:
    """Convert ``model``'s Linears per castwise's filter; emulated unless the model is on CUDA.
    ``target``: the GPU class the GEMMs are for (its float8 flavour: FNUZ on cuda:mi300x); None:
    the GPU the model is on."""
    if recipe.scaling not in RECIPES and not recipe.fp4:
        raise ApplyError(
            f"apply cannot run fp8={recipe} yet: torchao trains {', '.join(RECIPES)} (valid: fp8=tensorwise, "
            "fp8=rowwise, fp8=mxfp8); TransformerEngine's delayed and Megatron's blockwise recipes run in "
            "those frameworks (castwise.export writes their settings; castwise.compare emulates them)"
        )
    device = next((p.device.type for p in model.parameters()), "cpu")
    conv = Float8Conversion(plan(model, recipe, decisions), emulated=device != "cuda")
    if recipe.fp4:
        _fp4(model, conv)
        return conv
    if recipe.scaling == "mxfp8":
        _mxfp8(model, conv)
        return conv
    config = _float8_config(recipe, conv.emulated, fnuz(target, device))
    from torchao.float8.float8_linear import Float8Linear

    try:
        _swap_linears(model, conv, lambda m: Float8Linear.from_float(m, config=config))
    except BaseException:
        conv.undo()
        raise
    return conv
