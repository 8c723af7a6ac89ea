"""``castwise.audit``: run a model (forward, and backward in train mode) and report its dtype flow.

The audit runs on a fake copy of the model (no weight memory, any size) on the target device,
under the user's policy, with the tracer (castwise.trace.tracer) recording every op and the
origin of every tensor's dtype. Each op is checked against the real kernels' dtype contracts
(castwise.trace.contracts). Violations, the model's own errors, silent float32 up-casts and
what could not be checked become findings; a suggested policy is searched for by re-auditing
candidate fixes. The user's model and every global setting are left exactly as they were.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from castwise import _autocast
from castwise._dtypes import name_of, short_of
from castwise.errors import AuditError, CastwiseError, PolicyError, TargetError
from castwise.policy import ModuleRule, Policy
from castwise.report import Finding, Origin, Report, Run
from castwise.trace import fake as fake_mod
from castwise.trace.tracer import Event, Prov, Trace, Tracer, run

MODES = ("both", "eval", "train")
DEVICES = ("cpu", "cuda")
_LOW = (torch.float16, torch.bfloat16)
_DTYPE_WORDS = re.compile(
    r"dtype|scalar type|BFloat16|Half|Float\b|Double|float16|bfloat16|float32|float64|same type|"
    r"mixed dtype|type \(|should be the same",
)
_FAKE_LIMITS = (
    "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
    "UnsupportedFakeTensorException", "GuardOnDataDependentSymNode",
)


# -- arguments ----------------------------------------------------------------------------------


def _split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, list):
        return tuple(inputs), {}
    return (inputs,), {}


def _parse_policy(policy: Any) -> Policy | None:
    if policy is None:
        return None
    if isinstance(policy, (str, Policy)):
        return Policy.parse(policy)
    raise AuditError(f"policy must be a castwise.Policy, a policy string or None, not {type(policy).__name__}")


def _model_device(model: nn.Module) -> str:
    for t in (*model.parameters(), *model.buffers()):
        return "cpu" if t.device.type == "meta" else t.device.type
    return "cpu"


def _dominant_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    # a tie goes to float32: hand-casting goes the other way
    return max(counts, key=lambda d: (counts[d], d == torch.float32)) if counts else torch.float32


def _input_names(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    named = [(params[i] if i < len(params) else f"arg{i}", a) for i, a in enumerate(args)]
    return named + list(kwargs.items())


def _named_tensors(name: str, obj: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(name, obj)]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _named_tensors(f"{name}[{i}]", v)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _named_tensors(f"{name}[{k!r}]", v)]
    return []


# -- global state -------------------------------------------------------------------------------


@contextlib.contextmanager
def preserved_state() -> Iterator[None]:
    """Restore autocast, default dtype, grad mode, the MHA fast-path flag, the global random
    generators' states and the global module hook registries on exit, whatever happened inside."""
    from torch.nn.modules import module as module_mod

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    log_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # fake kernels log the shape errors the audit reports itself
    registries = [name for name in dir(module_mod) if name.startswith("_global_") and
                  isinstance(getattr(module_mod, name), dict)]
    saved = {name: dict(getattr(module_mod, name)) for name in registries}
    autocast_state = _autocast.AutocastState.capture()
    default_dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    fastpath_flag = torch.backends.mha.get_fastpath_enabled()
    # a real run draws from the global generators (dropout, random init in forward): the caller's
    # random stream must not depend on whether it audited
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for name, content in saved.items():
            registry = getattr(module_mod, name)
            registry.clear()
            registry.update(content)
        autocast_state.restore()
        torch.set_default_dtype(default_dtype)
        torch.set_grad_enabled(grad)
        torch.backends.mha.set_fastpath_enabled(fastpath_flag)
        fake_log.setLevel(log_level)


# -- one run ------------------------------------------------------------------------------------


@dataclass
class _Run:
    mode: str
    trace: Trace
    compute: torch.dtype
    param_dtypes: dict[str, int] = field(default_factory=dict)
    casts: list[tuple[str, str, torch.dtype, torch.dtype]] = field(default_factory=list)
    module_params: dict[str, dict[str, torch.dtype]] = field(default_factory=dict)
    tracer: Tracer | None = None
    fake: bool = True
    device: str = "cpu"
    dominant: torch.dtype = torch.float32  # the copy's most common parameter dtype, as it ran
    # (module, tensor, kind, dtype, expected dtype): tensors the policy left off its dtype
    unexpected: list[tuple[str, str, str, torch.dtype, torch.dtype]] = field(default_factory=list)


def _run_once(model: nn.Module, inputs: Any, policy: Policy | None, device: str, mode: str, fake: bool,
              compute: torch.dtype, record_ops: bool) -> _Run:
    from castwise.applied import apply, iter_casts

    args, kwargs = _split_inputs(inputs)
    named = _input_names(model, args, kwargs)
    fmode = fake_mod.new_mode() if fake else None
    if fmode is not None:
        copy = fake_mod.fake_model(model, fmode, device)
        memo: dict[int, torch.Tensor] = {}
        args = fake_mod.fake_inputs(args, fmode, device, memo)
        kwargs = fake_mod.fake_inputs(kwargs, fmode, device, memo)
        named = [(n, fake_mod.fake_inputs(v, fmode, device, memo)) for n, v in named]
    else:
        copy = fake_mod.real_model(model)
        args, kwargs = fake_mod.real_inputs(args), fake_mod.real_inputs(kwargs)
        named = _input_names(copy, args, kwargs)
    result = _Run(mode, Trace(), compute, fake=fake, device=device)
    with contextlib.ExitStack() as stack:
        # the run is defined by the policy alone, not by an autocast the caller happens to be in
        for device_type in _autocast.DEVICE_TYPES:
            stack.enter_context(_autocast.autocast(device_type, None, enabled=False))
        if fmode is not None and device == "cuda":
            # RNNs ask the CUDA runtime whether cuDNN can run, which fails without a GPU: run them on
            # the native CUDA path, whose cells carry cuDNN's dtype contract (trace/fastpath.py)
            stack.enter_context(torch.backends.cudnn.flags(enabled=False))
        if fmode is not None:
            stack.enter_context(fmode)
        applied = apply(copy, policy) if policy is not None else None
        if applied is not None:
            result.casts = [(m, n, d, _current_dtype(copy, m, n)) for m, n, d in iter_casts(applied)]
            result.unexpected = _unexpected_dtypes(copy, applied.policy, applied.decisions, result.casts)
        tracer = Tracer(copy, device, fake=fake, record_ops=record_ops)
        tracer.seed_inputs([x for n, v in named for x in _named_tensors(n, v)])
        if fmode is not None:
            originals = _split_inputs(inputs)
            real = [t for _n, t in _named_tensors("", originals)]
            tracer.seed_values([(memo[id(t)], t) for t in real if id(t) in memo])
        for p in copy.parameters():
            key = name_of(p.dtype)
            result.param_dtypes[key] = result.param_dtypes.get(key, 0) + p.numel()
        result.dominant = _dominant_dtype(copy)
        for mname, module in copy.named_modules():
            result.module_params[mname] = {n: p.dtype for n, p in module.named_parameters(recurse=False)}
        result.tracer = tracer
        result.trace = run(tracer, copy, args, kwargs, mode, engine_backward=(device == "cpu" or not fake))
    return result


def _unexpected_dtypes(model: nn.Module, policy: Policy, decisions: dict[str, Any],
                       casts: list[tuple[str, str, torch.dtype, torch.dtype]]) -> list[
                           tuple[str, str, str, torch.dtype, torch.dtype]]:
    """Floating parameters/buffers that, after ``apply``, are not in the dtype the policy gives
    them: what apply leaves alone (mixed policies cast nothing outside islands) in another dtype,
    e.g. a buffer cast to bf16 by hand in a model trained under bf16-mixed."""
    cast = {(m, n) for m, n, _b, _a in casts}
    out: list[tuple[str, str, str, torch.dtype, torch.dtype]] = []
    seen: set[int] = set()
    for mname, module in model.named_modules():
        island = _island_of(mname, decisions)
        for kind, store in (("param", module._parameters), ("buffer", module._buffers)):
            for tname, t in store.items():
                if t is None or id(t) in seen or not t.is_floating_point() or (mname, tname) in cast:
                    continue
                seen.add(id(t))
                if kind == "param":
                    want = island or policy.param_dtype
                else:
                    want = island or (policy.buffer_dtype if policy.is_mixed and policy.buffer_dtype is not None
                                      else policy.param_dtype if policy.is_mixed else policy.effective_buffer_dtype)
                if t.dtype != want:
                    out.append((mname, tname, kind, t.dtype, want))
    return out


def _island_of(name: str, decisions: dict[str, Any]) -> torch.dtype | None:
    """The dtype of the innermost island that holds module ``name`` (None: no island)."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        d = decisions.get(".".join(parts[:i]))
        if d is not None and d.island is not None:
            island: torch.dtype = d.island
            return island
    return None


def _current_dtype(model: nn.Module, module: str, name: str) -> torch.dtype:
    m = model.get_submodule(module) if module else model
    t = getattr(m, name, None)
    return t.dtype if isinstance(t, torch.Tensor) else torch.float32


# -- classification -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Diag:
    code: str
    module: str
    op: str | None
    origin: Origin | None
    message: str
    fix: str
    culprit_modules: tuple[str, ...] = ()
    expected: str | None = None


def _generalize(name: str) -> str:
    """``blocks.0.attn.q_norm`` -> ``blocks.*.attn.q_norm``: one rule for every repeated block."""
    return ".".join("*" if seg.isdigit() else seg for seg in name.split("."))


def _is_ancestor(parent: str, child: str) -> bool:
    return parent == "" or child == parent or child.startswith(parent + ".")


def _where(module: str) -> str:
    return f"`{module}`" if module else "the model's top level"


def _keep_fix(module: str, what: str = "Run") -> str:
    """How to make ``module`` a float32 island: a keep rule, or in words for the top level (no
    module rule selects the root: ``keep[]`` is not a selector)."""
    if module:
        return f"{what} `{module}` as a float32 island: policy rule `keep[{_generalize(module)}]=f32`"
    return (f"{what} that op in float32 in the model's top-level forward (`x.float()` before it and a cast "
            "back after it; a module rule cannot select the top level: move the op into a submodule and "
            "`keep[<that submodule>]=f32`)")


_UNSUPPORTED_TEXT = re.compile(
    r"not implemented for '(\w+)'|[Uu]nsupported dtype:? '?(\w+)|not supported for (?:dtype )?'?(\w+)'?|"
    r"does(?: not|n't) support (?:dtype |tensors of type:? )?'?(\w+)'?|dtypes not supported\. Got (\w+)",
)
_SCALAR_NAMES = {"BFloat16": torch.bfloat16, "Half": torch.float16, "Float": torch.float32,
                 "Double": torch.float64, "ComplexHalf": torch.complex32, "Long": torch.int64,
                 "Int": torch.int32, "Bool": torch.bool, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CUDA_RUNTIME = re.compile(
    r"nvidia driver|cuda driver|cuda error|torch not compiled with cuda|no cuda gpus|cudaerror|"
    r"cuda runtime|cuda_visible_devices|cudnn",
    re.IGNORECASE,
)


def _unsupported_dtype(text: str) -> torch.dtype | bool:
    """The dtype an "unsupported dtype" error names; True for a kernel that names none (oneDNN);
    False: not such an error."""
    if "could not create a primitive descriptor" in text:
        return True  # oneDNN has no kernel for these operands (e.g. a float16 LSTM on CPU)
    match = _UNSUPPORTED_TEXT.search(text)
    if match is None:
        return False
    word = next((g for g in match.groups() if g), "")
    # only a dtype the kernel names makes it a dtype problem ("does not support X" may be anything)
    return _SCALAR_NAMES.get(word, False)


def _cuda_runtime_error(exc: BaseException) -> bool:
    """The exception came from touching the real CUDA runtime (a fake CUDA audit's limit)."""
    names = {c.__name__ for c in type(exc).__mro__}
    return "AcceleratorError" in names or bool(_CUDA_RUNTIME.search(str(exc)))


def _culprits(dtypes: tuple[torch.dtype, ...], provs: tuple[Prov | None, ...], given: tuple[int, ...],
              compute: torch.dtype, own: dict[str, torch.dtype] | None = None) -> list[int]:
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


def _classify(*, phase: str, module: str, op: str | None, kind: str | None, text: str,
              dtypes: tuple[torch.dtype, ...], provs: tuple[Prov | None, ...], culprits: list[int],
              is_fast: bool, autocast: torch.dtype | None, compute: torch.dtype,
              expected: str | None, device: str = "cpu", dominant: torch.dtype | None = None,
              unsupported: torch.dtype | None = None, off_policy: frozenset[str] = frozenset()) -> _Diag:
    floats = [i for i in range(min(len(dtypes), len(provs))) if dtypes[i].is_floating_point]
    stray = [i for i in floats if (p := provs[i]) is not None and p.tensor in off_policy
             and any(dtypes[j] != dtypes[i] for j in floats)]
    if stray:
        # a tensor the policy left off its dtype (CW122) is the odd one wherever it meets others
        culprits = stray
    if not stray and autocast is None and culprits and all(dtypes[i] == compute for i in culprits
                                                         if i < len(dtypes)):
        # outside autocast the model's own dtype is the norm: the operand off it is the odd one
        odd = [i for i in floats if dtypes[i] != compute]
        if odd:
            culprits = odd
    culprit_provs = [p for p in (provs[i] for i in culprits if i < len(provs)) if p is not None]

    def own(p: Prov) -> bool:
        return p.kind in ("param", "buffer") and _is_ancestor(p.module, module)

    causes = [p for p in culprit_provs if not own(p)]
    if culprit_provs and not causes and not stray:
        # the table blames this module's own weights: the cause is the operand that differs from
        # them, unless the weights are themselves the odd ones (off the compute dtype the rest is in)
        wrong = culprit_provs[0].dtype
        others = [p for i, p in enumerate(provs) if p is not None and i < len(dtypes)
                  and dtypes[i].is_floating_point and dtypes[i] != wrong and not own(p)]
        if others and not (wrong != compute and all(p.dtype == compute for p in others)):
            causes = others
            culprits = [i for i, p in enumerate(provs) if p is not None and p in causes]
    culprit_provs = causes or culprit_provs
    first = culprit_provs[0] if culprit_provs else None
    origin = first.origin() if first else None
    got = ", ".join(sorted({short_of(dtypes[i]) for i in culprits if i < len(dtypes)}))
    at = f"{_where(module)}" + (f" ({op})" if op else "")
    comp = short_of(compute)
    modules = tuple(dict.fromkeys(p.module for p in culprit_provs if p.module))

    def diag(code: str, message: str, fix: str, org: Origin | None = origin,
             mods: tuple[str, ...] = modules) -> _Diag:
        return _Diag(code, module, op, org, message, fix, mods, expected)

    if kind == "unsupported":
        # one dtype has no kernel: nothing to cast "to the other side", run the op in float32
        bad = unsupported or next((dtypes[i] for i in culprits if i < len(dtypes)), None) \
            or next((d for d in dtypes if d.is_floating_point), None)
        name = short_of(bad) if bad is not None else got or "this dtype"
        src = f" (its {name} operand: {first.describe()})" if first is not None else ""
        message = (f"{at} has no {device.upper() if device == 'cpu' else 'CUDA'} kernel for {name}"
                   f"{' in backward' if phase == 'backward' else ''}{src}: {text}")
        if bad is not None and not bad.is_floating_point:
            return diag("CW111", message, f"Cast the {name} tensor to a floating dtype before {_where(module)} "
                        f"(`x.to(torch.{_torch_name(compute)})`).")
        back = (f"; its input is cast up to float32 and its output back to {comp}"
                if compute != torch.float32 and module else "")
        return diag("CW111", message, _keep_fix(module) + back + ".")
    if phase == "backward":
        return diag("CW112", f"In backward, {at} refuses its gradients' dtypes ({text}).",
                    "Keep gradients in their tensor's dtype: cast the loss, not the gradients (no "
                    "dtype-changing gradient hooks).")
    handcast = _hand_cast(module, dtypes, provs, autocast, dominant)
    if handcast is not None and kind not in ("mask",):
        param, act = handcast
        return diag(
            "CW113",
            f"{at}: {_where(param.module)}'s own {param.tensor} is {short_of(param.dtype)} while the rest of the "
            f"model and the activations reaching it are {short_of(act)}: that module's weights were cast by hand "
            f"(`.to({short_of(param.dtype)})` on one module?). Real error: {text}",
            f"Cast {_where(param.module)} back to {short_of(act)} with the rest of the model "
            f"(`{_module_expr(param.module)}.to(torch.{_torch_name(act)})`), or, if it is meant to run in "
            f"{short_of(param.dtype)}, cast its input: `x.to(torch.{_torch_name(param.dtype)})` before it.",
            param.origin(), (param.module,),
        )
    if is_fast:
        src = first.describe() if first else "autocast"
        return diag(
            "CW103",
            f"{at} takes the fused fast path (eval mode, no_grad, which CPU autocast does not turn off) and "
            f"the fused kernel does no autocast: its {got} input ({src}) meets {_others(dtypes, culprits)} "
            f"weights. Real error: {text}",
            "Turn the fast path off while autocast runs: add `fastpath=off` to the policy (castwise.apply "
            "does `torch.backends.mha.set_fastpath_enabled(False)` around the forward).",
        )
    if kind == "mask":
        return diag("CW108", f"{at}: the attention mask ({first.describe() if first else got}) is {got}, "
                    f"not the query's dtype. {text}",
                    "Build the mask with `dtype=q.dtype`, or pass a boolean mask.")
    if op is not None and "embedding" in op and any(d.is_floating_point for d in dtypes[1:2]):
        src = f" (from {first.describe()})" if first else ""
        return diag("CW110", f"{at} gets {short_of(dtypes[1])} indices{src}: embedding indices must be "
                    f"integers. {text}",
                    "Pass the embedding int64 (or int32) indices: `ids.long()` where they are made; never cast "
                    "token ids with the model's float dtype.")
    if kind in ("strict", "index"):
        mixed = ", ".join(short_of(d) for d in dtypes if d.is_floating_point)
        return diag("CW107", f"{at} needs identical dtypes and got {mixed}"
                    f" ({first.describe() if first else 'unknown origin'}). {text}",
                    "Cast the source to the destination's dtype at the write: `src.to(dst.dtype)`.")
    # CW101: float32 made inside this module meets this module's own low-precision parameters
    own_low = [p for p in provs if p is not None and p.kind in ("param", "buffer") and p.module == module
               and p.dtype in _LOW]
    own_up = [p for i, p in enumerate(provs) if p is not None and dtypes[i] == torch.float32
              and p.kind in ("cast", "op", "created") and p.module == module]
    if own_low and own_up:
        param = own_low[0]
        return diag(
            "CW101",
            f"{at} casts its input up to float32 ({own_up[0].op}) but its own {param.tensor} is "
            f"{short_of(param.dtype)}: the module computes in float32 and its weights were cast down "
            f"(a blanket `.to({short_of(param.dtype)})`?). Real error: {text}",
            f"Keep {_where(module)}'s parameters in float32: policy `{_true_preset(param.dtype)}` keeps norm "
            "layers as float32 islands"
            + (f" (or `keep[{_generalize(module)}]=f32`)" if module else "") + "; avoid a blanket `.to(dtype)`.",
            param.origin(), (module,),
        )
    if first is not None:
        if first.kind == "autocast" and first.dtype == torch.float32:
            return diag(
                "CW104",
                f"{at} takes only float16/bfloat16 operands of one dtype, but gets float32 {first.describe()} "
                f"(autocast runs that op in float32 on this device). Real error: {text}",
                f"Cast the float32 tensors to {comp} right before the kernel: policy rule "
                + (", ".join(f"`out[{_generalize(m)}]={comp}`" for m in (modules or (first.module,)) if m)
                   or "(the float32 is made at the model's top level: no module rule reaches it)")
                + f", or `x.to({comp})` in code.",
            )
        foreign = not _is_ancestor(first.module, module)
        if first.kind in ("param", "buffer") and first.dtype == torch.float32 and foreign and compute in _LOW:
            return diag(
                "CW102",
                f"{at} gets float32 from {_where(first.module)} ({first.tensor}), a module kept in float32 "
                f"whose output is not cast back, in a model computing in {comp}. Real error: {text}",
                f"Cast {_where(first.module)}'s output back to {comp} (saturating for f16): "
                f"`keep[{_generalize(first.module)}]=f32` islands cast back; `{_true_preset(compute)}` does "
                "it for _keep_in_fp32_modules." if first.module else
                f"Cast the float32 back to {comp} where it is made (the model's top level).",
            )
        if first.kind == "input":
            return diag(
                "CW105",
                f"{at}: {first.tensor} is {short_of(first.dtype)} but meets "
                f"{_others(dtypes, culprits)} weights, with no autocast. Real error: {text}",
                f"Cast the inputs with the model: policy clause `inputs={_others(dtypes, culprits) or comp}`.",
            )
        if first.kind in ("created", "attribute"):
            return diag(
                "CW106",
                f"{at}: {first.describe()} is {short_of(first.dtype)} (made with the default dtype, or a "
                f"tensor attribute .to() does not convert) and meets {_others(dtypes, culprits)}. Real error: {text}",
                "Create the tensor with `dtype=x.dtype` (or register it as a buffer so the model's casts "
                "reach it).",
            )
    if kind == "norm":
        return diag("CW109", f"{at}: norm input and weights/statistics differ ({got}). {text}",
                    "Make the norm a float32 island (input cast up, output cast back): the `*-true` presets "
                    "keep norms in float32 with casts at their boundaries.")
    src = f" ({first.describe()})" if first else ""
    return diag("CW110", f"{at} receives {got}{src}, which its real kernel refuses: {text}",
                "Cast one side to the other's dtype where they first meet; the origin names where the odd "
                "dtype came from.")


def _module_expr(name: str) -> str:
    """Python for the submodule ``name`` of ``model`` (get_submodule when a segment is an index)."""
    if all(seg.isidentifier() for seg in name.split(".")):
        return f"model.{name}"
    return f"model.get_submodule({name!r})"


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _hand_cast(module: str, dtypes: tuple[torch.dtype, ...], provs: tuple[Prov | None, ...],
               autocast: torch.dtype | None, dominant: torch.dtype | None) -> tuple[Prov, torch.dtype] | None:
    """(the module's odd parameter, the activations' dtype) when this module's own weights are off
    the model's dominant dtype while everything else reaching it is in it: weights cast by hand."""
    if autocast is not None or dominant is None or not module:
        return None
    own_odd = [p for p in provs if p is not None and p.kind in ("param", "buffer") and p.module == module
               and p.dtype.is_floating_point and p.dtype != dominant]
    rest = [d for i, d in enumerate(dtypes) if d.is_floating_point and i < len(provs)
            and not (provs[i] is not None and provs[i].kind in ("param", "buffer")  # type: ignore[union-attr]
                     and provs[i].module == module)]  # type: ignore[union-attr]
    if own_odd and rest and all(d == dominant for d in rest):
        # name the weight when it is among them (the bias comes first in addmm's operands)
        own_odd.sort(key=lambda p: not (p.tensor or "").endswith(".weight"))
        return own_odd[0], dominant
    return None


def _others(dtypes: tuple[torch.dtype, ...], culprits: list[int]) -> str:
    rest = {short_of(d) for i, d in enumerate(dtypes) if i not in culprits and d.is_floating_point}
    return ", ".join(sorted(rest))


def _true_preset(dtype: torch.dtype) -> str:
    return "16-true" if dtype == torch.float16 else "bf16-true"


def _from_event(ev: Event, r: _Run) -> _Diag:
    v = ev.violation
    kind = v.kind if v is not None else None
    text = v.message if v is not None else f"{type(ev.error).__name__}: {ev.error}"
    given = v.culprits if v is not None else ()
    culprits = _culprits(ev.dtypes, ev.provs, given, r.compute)
    return _classify(phase=ev.phase, module=ev.module, op=ev.op, kind=kind, text=text, dtypes=ev.dtypes,
                     provs=ev.provs, culprits=culprits, is_fast=ev.fastpath, autocast=ev.autocast,
                     compute=r.compute, expected=v.expected if v is not None else None, device=r.device,
                     dominant=r.dominant, off_policy=_off_policy(r))


def _off_policy(r: _Run) -> frozenset[str]:
    """The provenance names of the tensors the policy left off its dtype (as the tracer names them)."""
    return frozenset(f"{kind} {m + '.' if m else ''}{n}" for m, n, kind, _d, _w in r.unexpected)


def _forward_echo(ev: Event, forward: list[Event]) -> bool:
    """A backward violation that only repeats a forward one: the fake run went on past a forward
    error (the real run would have stopped there), and the same op's backward meets the same mix."""
    if ev.phase != "backward":
        return False
    return any(f.module == ev.module or f.op == ev.op for f in forward)


def _fake_limit(exc: BaseException) -> bool:
    """The fake-tensor machinery could not run an op: a limit of the audit, not a model error."""
    names = {c.__name__ for c in type(exc).__mro__}
    text = str(exc).lower()
    return bool(names & set(_FAKE_LIMITS)) or "nestedtensorimpl" in text or "fake tensor" in text \
        or "data-dependent" in text or "data dependent" in text


def _data_dependent(exc: BaseException) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    text = str(exc).lower()
    return bool(names & {"DataDependentOutputException", "DynamicOutputShapeException",
                         "GuardOnDataDependentSymNode"}) or "data-dependent" in text or "data dependent" in text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _diags_of_run(r: _Run) -> list[_Diag]:
    """The error findings of one run: contract violations, then what the model raised."""
    trace = r.trace
    forward = [ev for ev in trace.events if ev.phase == "forward"]
    out = [_from_event(ev, r) for ev in trace.events if not _forward_echo(ev, forward)]
    exc = trace.error
    if exc is None:
        return out
    fail = trace.failure
    last = trace.events[-1] if trace.events else None
    if fail is not None and last is not None and last.op == fail.op and last.module == fail.module:
        return out  # the real kernel raised what the table predicted (real mode): already reported
    module = trace.stack[-1].name if trace.stack else (fail.module if fail else "")
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    if forward and trace.error_phase == "backward" and r.fake:
        return out  # backward of a forward the real run would not have finished
    unsupported = _unsupported_dtype(str(exc))
    kind = "unsupported" if unsupported is not False else None
    bad = unsupported if isinstance(unsupported, torch.dtype) else None
    cuda_limit = r.fake and r.device == "cuda" and _cuda_runtime_error(exc)
    if r.fake and (_fake_limit(exc) or cuda_limit) and kind is None:
        op = fail.op if fail else None
        where = f"{op or 'an op'} in {_where(module)}"
        why = (f"it needed the real CUDA runtime, which a simulated CUDA device does not have ({text}): a "
               "limit of the simulation, not an error in the model" if cuda_limit else
               (f"it needs a tensor's values (`.item()`, `if x.any():`, `nonzero`...), which fake tensors do "
                f"not have ({text})" if _data_dependent(exc) else f"fake tensors cannot run it ({text})")
               + ": a limit of the simulation, not an error in the model")
        out.append(_Diag(
            "CW902", fail.module if fail else module, op, None,
            f"PART OF THE MODEL WAS NOT CHECKED. The fake-tensor run stopped at {where}: {why}. No op after "
            "it was checked, so this report cannot say the rest is free of dtype errors.",
            "Check the rest on real tensors: `castwise audit <file.py:build> --real` (`fake=False` in "
            "castwise.audit) on a small configuration of the model (real CPU tensors, same policy)"
            + (" with device='cpu'" if r.device == "cuda" else "") + ".",
        ))
    elif (kind is not None or _DTYPE_WORDS.search(str(exc))) and fail is not None:
        # an op raised on dtypes (a custom op's own check, a kernel in a real run)
        culprits = _culprits(fail.dtypes, fail.provs, (), r.compute)
        out.append(_classify(phase=fail.phase, module=fail.module, op=fail.op, kind=kind, text=text,
                             dtypes=fail.dtypes, provs=fail.provs, culprits=culprits, is_fast=fail.fastpath,
                             autocast=fail.autocast, compute=r.compute, expected=None, device=r.device,
                             dominant=r.dominant, unsupported=bad, off_policy=_off_policy(r)))
    elif kind is not None or _DTYPE_WORDS.search(str(exc)):
        # Python code raised on dtypes (a strict layer's own check): the module's inputs and weights
        frame = trace.stack[-1] if trace.stack else None
        tensors = [t for t in frame.inputs if t.is_floating_point()] if frame else []
        own = r.module_params.get(module, {})
        prov_of = r.tracer.prov_of if r.tracer is not None else (lambda t: None)
        provs = tuple(prov_of(t) for t in tensors) + tuple(
            Prov("param", module, None, f"param {module + '.' if module else ''}{n}", d) for n, d in own.items()
        )
        dtypes = tuple(t.dtype for t in tensors) + tuple(own.values())
        culprits = _culprits(dtypes, provs, (), r.compute, own)
        out.append(_classify(phase=trace.error_phase, module=module, op=None, kind=kind, text=text,
                             dtypes=dtypes, provs=provs, culprits=culprits, is_fast=False,
                             autocast=frame.autocast if frame else None, compute=r.compute, expected=None,
                             device=r.device, dominant=r.dominant, unsupported=bad, off_policy=_off_policy(r)))
    else:
        out.append(_Diag(
            "CW130", module, fail.op if fail else None, None,
            f"{_where(module)} raised {text} (not a dtype problem as far as castwise can tell).",
            "Fix the error the message names, then re-run the audit.",
        ))
    return out


def _merge(per_mode: dict[str, list[_Diag]]) -> list[tuple[_Diag, tuple[str, ...], int, list[str]]]:
    """One entry per (code, module pattern, op): the first diagnosis, its modes, how many places."""
    merged: dict[tuple[str, str, str | None], tuple[_Diag, list[str], list[str]]] = {}
    for mode, diags in per_mode.items():
        for d in diags:
            key = (d.code, "", d.op)  # one finding per rule and op; other places listed in it
            if key not in merged:
                merged[key] = (d, [mode], [d.module])
                continue
            first, modes, places = merged[key]
            if mode not in modes:
                modes.append(mode)
            if d.module not in places:
                places.append(d.module)
            if d.culprit_modules:
                extra = tuple(m for m in d.culprit_modules if m not in first.culprit_modules)
                if extra:
                    merged[key] = (_Diag(first.code, first.module, first.op, first.origin, first.message, first.fix,
                                         first.culprit_modules + extra, first.expected), modes, places)
    return [(d, tuple(m for m in ("train", "eval") if m in modes), len(places), places)
            for d, modes, places in merged.values()]


def _finding(d: _Diag, modes: tuple[str, ...], places: list[str]) -> Finding:
    message = d.message.rstrip()
    if not message.endswith((".", "?", "!")):
        message += "."
    if len(places) > 1:
        more = ", ".join(f"`{p}`" for p in places[1:4]) + (", ..." if len(places) > 4 else "")
        message += f" Also at {more}." if len(places) == 2 else f" Also at {len(places) - 1} more modules: {more}."
    details: list[tuple[str, Any]] = []
    if d.culprit_modules:
        details.append(("culprit_modules", list(d.culprit_modules)))
    if len(places) > 1:
        details.append(("also_at", places[1:]))
    return Finding(code=d.code, message=message, module=d.module, op=d.op, origin=d.origin, modes=modes,
                   fix=d.fix, details=tuple(details))


def _warnings(runs: list[_Run], policy: Policy | None) -> list[Finding]:
    out: list[Finding] = []
    # CW120: silent float32 up-casts outside autocast, one finding per origin
    seen: dict[tuple[str | None, str], tuple[Any, list[str]]] = {}
    for r in runs:
        failed = [ev.module for ev in r.trace.events if ev.phase == "forward"]
        if r.trace.failure is not None:
            failed.append(r.trace.failure.module)
        for u in r.trace.upcasts:
            if any(_is_ancestor(u.module, m) and (m or not u.module) for m in failed):
                continue  # it did not return float32: it raised (or the real kernel would have)
            # one finding per origin, repeated blocks (blocks.0.wo, blocks.1.wo...) counted as one
            key = (_generalize(u.prov.module) if u.prov else None, _generalize(u.module) if u.prov is None else "")
            entry = seen.setdefault(key, (u, []))
            if r.mode not in entry[1]:
                entry[1].append(r.mode)
    # report the innermost module of each origin (the first recorded: post-hooks run inner first)
    act = _activation_share(runs)
    for u, modes in seen.values():
        origin = u.prov.origin() if u.prov else None
        src = u.prov.describe() if u.prov else "an op in it"
        out.append(Finding(
            code="CW120", module=u.module, op=u.prov.op if u.prov else None, origin=origin,
            modes=tuple(m for m in ("train", "eval") if m in modes),
            message=(f"{_where(u.module)} takes {short_of(u.in_dtype)} activations and returns float32 "
                     f"({src}); later modules then run in float32 while the model is meant to compute in "
                     f"{short_of(u.in_dtype)}.{act}"),
            fix=(f"Cast the float32 back to {short_of(u.in_dtype)} where it is made: a float32 island with "
                 f"cast-back (`keep[{_generalize(u.prov.module if u.prov and u.prov.module else u.module)}]=f32`; "
                 f"`{_true_preset(u.in_dtype)}` does it for _keep_in_fp32_modules and norms)."),
        ))
    # CW122: tensors the policy leaves off the dtype it gives them (apply casts the rest)
    if policy is not None and runs and runs[0].unexpected:
        groups: dict[tuple[str, torch.dtype, torch.dtype], list[str]] = {}
        for m, n, kind, dtype, want in runs[0].unexpected:
            groups.setdefault((kind, dtype, want), []).append(f"{m}.{n}" if m else n)
        for (kind, dtype, want), names in groups.items():
            sample = ", ".join(f"`{x}`" for x in names[:3]) + (", ..." if len(names) > 3 else "")
            owner = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
            how = ("mixed policies leave the model's tensors as they are and autocast at each op"
                   if policy.is_mixed else "castwise.apply leaves it as it is")
            if kind == "buffer":
                fix = (f"Store it in {short_of(want)} (make it with `dtype=torch.{_torch_name(want)}` or `.to()` it "
                       f"where it is made), or add `buffers={short_of(dtype)}` to the policy if {short_of(dtype)} is "
                       "meant.")
            else:
                fix = (f"Cast it back to {short_of(want)} (it was probably cast by hand), or make its module an "
                       f"island in {short_of(dtype)}: " + (f"`keep[{_generalize(owner)}]={short_of(dtype)}`."
                                                           if owner else "a rule on the module that owns it."))
            out.append(Finding(
                code="CW122", module=owner, origin=Origin(owner or None, None, f"{kind} {names[0]}"),
                modes=tuple(r.mode for r in runs),
                message=(f"{len(names)} {kind}(s) stay {short_of(dtype)} under policy {policy}, which gives them "
                         f"{short_of(want)} ({sample}): {how}, so ops autocast does not manage (index_put, "
                         f"cat, in-place writes, custom kernels) see {short_of(dtype)} meet {short_of(want)}."),
                fix=fix,
            ))
    # CW901: ops the contract table does not know
    uncovered: dict[str, set[str]] = {}
    for r in runs:
        for op, modules in r.trace.uncovered.items():
            uncovered.setdefault(op, set()).update(modules)
    if uncovered:
        ops = sorted(uncovered)
        listed = ", ".join(ops[:12]) + (f" and {len(ops) - 12} more" if len(ops) > 12 else "")
        first = sorted(uncovered[ops[0]])[0]
        out.append(Finding(
            code="CW901", module=first, op=ops[0], modes=tuple(r.mode for r in runs),
            message=f"{len(ops)} op(s) ran without a dtype contract to check them against: {listed}.",
            fix="Audit with --real on a small configuration to check them on real kernels.",
            details=(("unchecked_ops", ops),),
        ))
    return out


def _activation_share(runs: list[_Run]) -> str:
    total: dict[str, int] = {}
    for r in runs[:1]:
        total = dict(r.trace.activation_bytes)
    all_bytes = sum(total.values())
    if not all_bytes or "float32" not in total:
        return ""
    return f" float32 holds {100 * total['float32'] / all_bytes:.0f}% of activation bytes."


# -- the audit ----------------------------------------------------------------------------------


def _check_args(model: Any, policy: Any, device: Any, mode: Any, fake: Any) -> tuple[Policy | None, str]:
    if not isinstance(model, nn.Module):
        raise AuditError(f"audit needs a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise AuditError(f"mode={mode!r} is not valid; valid: {', '.join(sorted(MODES))}")
    if device is not None and device not in DEVICES:
        raise AuditError(f"device={device!r} is not valid; valid: {', '.join(sorted(DEVICES))} (or None: where "
                         "the model is)")
    from castwise.applied import applied_to

    applied = applied_to(model)
    if applied is not None:
        # its forwards are wrapped by closures over this very object, which a copy would still call
        raise AuditError(
            f"{type(model).__name__} is under castwise.apply (policy {applied.policy}); audit the model as it "
            f"was before applying, with policy='{applied.policy}', or call .remove() on the Applied first"
        )
    if not isinstance(fake, bool):
        raise AuditError(f"fake={fake!r} is not valid; valid: False, True")
    try:
        pol = _parse_policy(policy)
    except PolicyError as exc:
        raise AuditError(f"policy: {exc}") from exc
    dev = device or _model_device(model)
    if dev not in DEVICES:
        raise AuditError(f"the model is on {dev!r}; castwise simulates {', '.join(DEVICES)}: pass device='cpu' or "
                         "device='cuda'")
    if not fake and dev == "cuda" and not torch.cuda.is_available():
        raise AuditError("a real-tensor audit (fake=False) runs on this machine, which has no CUDA device; "
                         "audit device='cuda' with fake=True (the default)")
    return pol, dev


def _compute_dtype(model: nn.Module, policy: Policy | None) -> torch.dtype:
    if policy is not None:
        return policy.compute_dtype
    return _dominant_dtype(model)


def _audit(model: nn.Module, inputs: Any, policy: Policy | None, device: str, mode: str, fake: bool,
           *, record_ops: bool = True) -> tuple[Report, list[_Run], dict[str, list[_Diag]]]:
    compute = _compute_dtype(model, policy)
    modes = ["train", "eval"] if mode == "both" else [mode]
    runs: list[_Run] = []
    with preserved_state():
        for m in modes:
            runs.append(_run_once(model, inputs, policy, device, m, fake, compute, record_ops))
    per_mode = {r.mode: _diags_of_run(r) for r in runs}
    findings = [_finding(d, ms, places) for d, ms, _n, places in _merge(per_mode)]
    errors_by_mode = {m: [f for f in findings if f.level == "error" and m in f.modes] for m in per_mode}
    if len(runs) == 2:
        bad = [m for m, errs in errors_by_mode.items() if errs]
        if len(bad) == 1:
            good = next(m for m in errors_by_mode if m not in bad)
            first = errors_by_mode[bad[0]][0]
            findings.append(Finding(
                code="CW121", module=first.module, op=first.op, origin=first.origin, modes=(bad[0],),
                message=(f"The model passes in {good} mode and fails in {bad[0]} mode ({first.code} at "
                         f"{_where(first.module or '')}): "
                         + ("training runs, and the first validation step crashes."
                            if bad[0] == "eval" else "validation runs, and training crashes.")),
                fix=f"See the {first.code} finding; the suggested policy fixes both modes.",
            ))
    findings += _warnings(runs, policy)
    report = Report(
        findings=findings,
        runs=[Run(r.mode, device, None if policy is None else str(policy), _status(r.mode, findings))
              for r in runs],
        summary={
            "params_by_dtype": dict(runs[0].param_dtypes) if runs else {},
            "activation_bytes_by_dtype": dict(runs[0].trace.activation_bytes) if runs else {},
            "ops_traced": {r.mode: len(r.trace.ops) for r in runs},
        },
        title=f"castwise audit ({'fake' if fake else 'real'} tensors, device {device}, policy "
              f"{policy if policy is not None else 'none'})",
    )
    return report, runs, per_mode


def _status(mode: str, findings: list[Finding]) -> str:
    """"error" when a finding of this mode is an error, "incomplete" when the run stopped before
    the end (CW902: part of the model was not checked), else "ok"."""
    here = [f for f in findings if mode in f.modes]
    if any(f.level == "error" for f in here):
        return "error"
    if any(f.code == "CW902" for f in here):
        return "incomplete"
    return "ok"


def audit(model: nn.Module, inputs: Any, *, policy: Policy | str | None = None, device: str | None = None,
          mode: str = "both", fake: bool = True) -> Report:
    """Run ``model`` on ``inputs`` (forward, and backward in train mode) and report its dtype flow.

    ``inputs``: a tensor, a tuple of positional args or a dict of keyword args. ``policy``: a
    Policy or any string ``Policy.parse`` accepts (None: the model as it is, no autocast).
    ``device``: the target device to simulate ("cpu", "cuda"; default where the model is).
    ``mode``: "train" (forward + backward), "eval" (eval() under no_grad) or "both".
    ``fake``: fake tensors (no weight memory, any size); False: real tensors on this machine.
    The user's model and every global setting are left as they were, also when the model raises.
    """
    from castwise.distributed.audit import is_sharded

    if is_sharded(model):  # FSDP2 (DTensor parameters): per-unit dtypes, findings of what the units compute
        from castwise.distributed.audit import audit_sharded

        return audit_sharded(model, inputs, policy=policy, device=device, mode=mode, fake=fake)
    pol, dev = _check_args(model, policy, device, mode, fake)
    report, runs, _ = _audit(model, inputs, pol, dev, mode, fake)
    if not report.ok:
        report.suggested_policy = suggest_policy(model, inputs, pol, dev, mode, fake, report, runs)
    return report


# -- suggested policy -----------------------------------------------------------------------------


def _base_policy(policy: Policy | None, compute: torch.dtype) -> Policy:
    if policy is not None:
        return policy
    if compute in _LOW:
        return Policy.parse(_true_preset(compute))
    return Policy.parse("32-true")


def _fixes(policy: Policy, findings: list[Finding], compute: torch.dtype) -> Policy:
    """One step: the policy with the fixes the error findings point at."""
    p = policy
    comp = compute
    rules: list[ModuleRule] = []

    def add(selector: str, dtype: torch.dtype, kind: str) -> None:
        if not selector or selector in ("*",):
            return
        rule = ModuleRule(selector, dtype, kind)  # type: ignore[arg-type]
        if rule not in p.rules and rule not in rules:
            rules.append(rule)

    for f in findings:
        if f.level != "error":
            continue
        details = dict(f.details)
        culprits = list(details.get("culprit_modules", []))
        if not culprits and f.origin is not None and f.origin.module:
            culprits = [f.origin.module]
        if f.code == "CW103":
            p = p.replace(fastpath=False)
        elif f.code in ("CW101", "CW109", "CW111"):
            if p.norms is None and not p.is_mixed and p.compute_dtype in _LOW:
                p = p.replace(norms=torch.float32)
            add(_generalize(f.module or ""), torch.float32, "keep")
        elif f.code == "CW102":
            for m in culprits:
                add(_generalize(m), torch.float32, "keep")
        elif f.code == "CW105":
            if not p.is_mixed:
                p = p.replace(input_dtype=p.param_dtype)
        elif f.code in ("CW104", "CW106", "CW107", "CW108", "CW110"):
            for m in culprits:
                add(_generalize(m), comp, "out")
    if rules:
        p = p.with_rules(*rules)
    return p


def suggest_policy(model: nn.Module, inputs: Any, policy: Policy | None, device: str, mode: str, fake: bool,
                   report: Report, runs: list[_Run], max_audits: int = 5) -> Policy | None:
    """A policy under which a re-audit finds no error, keeping the user's compute dtype.

    Candidates: the preset for the model's dtype (when it ran without a policy), then that with
    the fixes the findings point at, then, step by step, the fixes the re-audits' findings point
    at. Each candidate is verified by a re-audit in the user's own mode (fake or real tensors);
    the first clean one that changes what runs is returned. A candidate that only re-spells the
    user's policy (the same policy, or one under which every op runs exactly as before) is never
    returned: None when no candidate really fixes the model.
    """
    compute = _compute_dtype(model, policy)
    base = _base_policy(policy, compute)
    queue: list[tuple[Policy, list[Finding]]] = []
    if policy is None:
        queue.append((base, report.findings))
    tried: set[str] = set() if policy is None else {str(policy)}
    before = _signature(runs)
    incomplete = any(f.code == "CW902" for f in report.findings)
    candidate = _safe_fixes(base, report.findings, compute)
    if candidate is not None:
        queue.append((candidate, report.findings))
    audits = 0
    while queue and audits < max_audits:
        candidate, _ = queue.pop(0)
        if str(candidate) in tried or candidate == policy:
            continue
        tried.add(str(candidate))
        audits += 1
        try:
            again, again_runs, _ = _audit(model, inputs, candidate, device, mode, fake)
        except CastwiseError:
            continue
        # a candidate whose run stops earlier than the user's (CW902) is not verified by it
        cut_short = any(f.code == "CW902" for f in again.findings) and not incomplete
        if again.ok and not cut_short and _signature(again_runs) != before:
            return candidate
        following = _safe_fixes(candidate, again.findings, compute)
        if following is not None and str(following) not in tried:
            queue.append((following, again.findings))
    return None


def _signature(runs: list[_Run]) -> list[Any]:
    """Every op each run traced, with its operands' dtypes: two policies with the same signature
    run the model identically (one is a no-op re-spelling of the other)."""
    return [(r.mode, r.trace.ops, r.trace.error is not None) for r in runs]


def _safe_fixes(policy: Policy, findings: list[Finding], compute: torch.dtype) -> Policy | None:
    try:
        fixed = _fixes(policy, findings, compute)
    except CastwiseError:  # two rules that disagree on a module: not a candidate
        return None
    return None if fixed == policy else fixed


# -- CLI targets ----------------------------------------------------------------------------------


def load_target(target: str) -> tuple[nn.Module, Any]:
    """Load ``path/to/file.py:function`` or ``package.module:function`` and call it: (model, inputs)."""
    if ":" not in target:
        raise TargetError(f"target {target!r} names no function; valid forms: module:function, path/file.py:function")
    where, _, func_name = target.rpartition(":")
    if not where or not func_name.isidentifier():
        raise TargetError(f"target {target!r}: {func_name!r} is not a function name; valid forms: module:function, "
                          "path/file.py:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"target {target!r}: no file {where!r}")
        mod_name = f"castwise_target_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise TargetError(f"target {target!r}: cannot load {where!r} as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look their module up there
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise TargetError(f"target {target!r}: importing {where} raised {type(exc).__name__}: {exc}") from exc
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise TargetError(f"target {target!r}: cannot import module {where!r} ({type(exc).__name__}: {exc})") \
                from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise TargetError(f"target {target!r}: {where} has no function {func_name!r}; functions there: "
                          f"{', '.join(names) or '(none)'}")
    try:
        result = func()
    except Exception as exc:
        raise TargetError(f"target {target!r}: {func_name}() raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise TargetError(f"target {target!r}: {func_name}() must return (model, inputs) with an nn.Module, got "
                          f"{type(result).__name__}")
    return result[0], result[1]


__all__ = ["audit", "load_target", "preserved_state", "suggest_policy"]
