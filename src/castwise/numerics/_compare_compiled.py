"""``compare(torch.compile(model), inputs, policy=..., reference="eager")``: where do the compiled
program's numerics leave the eager program's?

Both programs run the policy on a copy of the module ``torch.compile`` wraps (the user's model
and compiled module are never called). The eager copy runs once with every module call recorded
(inputs, outputs, autocast state), and so does a float32 copy. Capturing intermediate outputs
inside one compiled graph would change what Inductor fuses (a captured value is materialized,
so rounded), so modules are not observed inside the compiled model: each module is compiled
*alone* (the user's ``fullgraph``/``dynamic``, Inductor) and run on the eager run's inputs for
that call, under the autocast state it had. What its compiled output differs from the eager
output is what that module's compiled code adds. The walk starts at the model itself (the whole
compiled program against the whole eager one) and descends only into a module whose compiled
code diverges past the tolerance, children in call order; the deepest diverging module on that
path is named. A module whose forward is one kernel (Linear, Conv, norms, activations...) is not
compiled alone: one kernel rounds once in both programs.

At the named module the compile is repeated with
``torch._inductor.config.emulate_precision_casts=True`` (Inductor rounds where eager rounds);
the config is restored after. Every compile is isolated (``isolate_recompiles``) and its Dynamo
cache entries are dropped after the comparison.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from castwise import _autocast
from castwise._compiled import CompileOptions
from castwise.numerics._compare_core import TOLERANCE_FACTOR, _pair_calls, _short, reference_run
from castwise.numerics._compare_iso import err, unit_roundoff
from castwise.numerics._compare_run import Call, Recording, float_tensors, record
from castwise.numerics._compare_target import Target, parse_target, prepared
from castwise.numerics._failed import raised_in
from castwise.run import Inputs, map_tensors

# one kernel each: eager and Inductor round their result once, so alone they cannot diverge
# past rounding (a divergence needs several ops, or a reduction split differently)
_ONE_KERNEL: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Embedding,
    nn.Identity,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.dropout._DropoutNd,
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softmax,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
)


@dataclass(frozen=True)
class CompiledRow:
    """One module compiled alone on the eager run's inputs (relative L2 errors)."""

    module: str
    dtype: str  # the narrowest format it computed in (eager run)
    compiled_err: float  # its compiled output vs its eager output, same inputs: what compiling adds
    eager_f32_err: float | None  # its eager output (in the eager run) vs float32's
    compiled_f32_err: float | None  # its compiled output vs float32's
    tolerance: float  # TOLERANCE_FACTOR x the unit roundoff of `dtype`
    emulated_err: float | None = None  # compiled with emulate_precision_casts=True (the named module)
    error: str | None = None  # it could not be compiled alone (what raised)

    @property
    def past_tolerance(self) -> bool:
        return self.error is None and not self.compiled_err <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        def num(x: float | None) -> float | str | None:
            if x is None or math.isnan(x):
                return None
            return "inf" if math.isinf(x) else float(f"{x:.6g}")

        return {
            "module": self.module,
            "dtype": self.dtype,
            "compiled_vs_eager": num(self.compiled_err),
            "eager_vs_f32": num(self.eager_f32_err),
            "compiled_vs_f32": num(self.compiled_f32_err),
            "tolerance": num(self.tolerance),
            "past_tolerance": self.past_tolerance,
            "emulated_vs_eager": num(self.emulated_err),
            "error": self.error,
        }


@dataclass(frozen=True)
class CompiledMeasurement:
    rows: tuple[CompiledRow, ...]  # in the order they were compiled (the walk's path)
    first: CompiledRow | None  # the first (deepest) module where compiled and eager diverge
    compiles: int


class _Session:
    """Compiles of one comparison: isolated, their Dynamo cache entries dropped at the end and
    Dynamo's and Inductor's configs restored."""

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self.compiles = 0

    @contextlib.contextmanager
    def open(self) -> Iterator[_Session]:
        import torch._dynamo
        import torch._inductor.config as inductor_config
        from torch._dynamo.convert_frame import register_bytecode_hook

        from castwise.trace.compiled import _Entries

        configs = (torch._dynamo.config, inductor_config)
        saved = [cfg.get_config_copy() for cfg in configs]
        self._entries: list[_Entries] = []
        handle = register_bytecode_hook(self._hook)
        try:
            yield self
        finally:
            handle.remove()
            for entries in self._entries:
                entries.drop()
            for cfg, before in zip(configs, saved, strict=True):
                # only what changed: setting every key would warn for each deprecated one
                after = cfg.get_config_copy()
                for key, value in before.items():
                    if after.get(key) != value:
                        setattr(cfg, key, value)

    def _hook(self, code: Any, new_code: Any) -> Any:
        for entries in self._entries:
            entries.hook(code, new_code)
        return None

    @staticmethod
    def isolating() -> bool:
        """Whether each compile is its own (``isolate_recompiles``, torch >= 2.13): without it a
        second compile of a module would reuse the first's code, whatever Inductor's config says."""
        return "isolate_recompiles" in inspect.signature(inspect.unwrap(torch.compile)).parameters

    def run(self, call: Call, emulate: bool = False) -> Any:
        """``call.module`` compiled alone (a fresh compile), run on ``call``'s recorded inputs."""
        import torch._inductor.config as inductor_config

        from castwise.trace.compiled import _Entries

        compile_fn = inspect.unwrap(torch.compile)
        isolate: dict[str, Any] = {"isolate_recompiles": True} if self.isolating() else {}
        compiled = compile_fn(
            call.module, backend="inductor", fullgraph=self.options.fullgraph, dynamic=self.options.dynamic, **isolate
        )
        self._entries.append(_Entries(getattr(getattr(compiled, "dynamo_ctx", None), "_isolate_recompiles_id", -1)))
        self.compiles += 1
        args = map_tensors(call.args, lambda t: t.clone())
        kwargs = map_tensors(call.kwargs, lambda t: t.clone())
        before = _autocast.AutocastState.capture()
        try:
            call.autocast.restore()
            with torch.no_grad(), inductor_config.patch(emulate_precision_casts=emulate):
                return compiled(*args, **kwargs) if isinstance(args, tuple) else compiled(args, **kwargs)
        finally:
            before.restore()


def divergence(a: Any, b: Any) -> float:
    """Relative L2 of ``a`` against ``b``; inf where one holds inf/nan the other does not (an f16
    overflow one program makes and the other avoids), whichever of the two it is."""
    for x, y in zip(float_tensors(a), float_tensors(b), strict=False):
        if x.shape == y.shape and not torch.equal(torch.isfinite(x), torch.isfinite(y)):
            return math.inf
    return err(a, b).value


def _children(calls: list[Call], parent: Call) -> list[Call]:
    return [c for c in calls if c.parent == parent.index]


def _row(session: _Session, call: Call, callees: list[Call], ref: Call | None) -> tuple[CompiledRow, Any]:
    tol = TOLERANCE_FACTOR * unit_roundoff(call, callees)
    dtype = _short(tol / TOLERANCE_FACTOR)
    eager_f32 = err(call.out, ref.out).value if ref is not None else None
    try:
        out = session.run(call)
    except Exception as exc:  # Dynamo or Inductor refused this module alone
        text = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {text[0] if text else ''}"
        return CompiledRow(call.name, dtype, math.nan, eager_f32, None, tol, error=why), None
    compiled_f32 = err(out, ref.out).value if ref is not None else None
    return CompiledRow(call.name, dtype, divergence(out, call.out), eager_f32, compiled_f32, tol), out


def _walk(session: _Session, low: Recording, refs: dict[int, Call]) -> tuple[list[CompiledRow], CompiledRow | None]:
    """From the model itself down: the deepest module, first in call order, whose compiled code
    alone diverges from eager past its tolerance."""
    rows: list[CompiledRow] = []
    done: set[str] = set()  # a module called again adds what it added the first time
    call = low.calls[0]
    row, _ = _row(session, call, _children(low.calls, call), refs.get(call.index))
    rows.append(row)
    if not row.past_tolerance:
        return rows, None
    named = row
    while True:
        deeper = None
        for child in _children(low.calls, call):
            if child.name in done or isinstance(child.module, _ONE_KERNEL) or child.out is None:
                continue
            done.add(child.name)
            crow, _ = _row(session, child, _children(low.calls, child), refs.get(child.index))
            rows.append(crow)
            if crow.past_tolerance:
                deeper = (child, crow)
                break
        if deeper is None:
            return rows, named
        call, named = deeper


def _emulated(session: _Session, low: Recording, row: CompiledRow) -> CompiledRow:
    call = next(c for c in low.calls if c.name == row.module)
    if not session.isolating():  # the emulating compile would not happen: no answer
        return row
    try:
        out = session.run(call, emulate=True)
    except Exception:  # the emulating compile raised: no answer
        return row
    return CompiledRow(
        row.module,
        row.dtype,
        row.compiled_err,
        row.eager_f32_err,
        row.compiled_f32_err,
        row.tolerance,
        divergence(out, call.out),
    )


def _without_cache(model: nn.Module, inputs: Inputs) -> Inputs:
    """Keyword inputs with ``use_cache=False`` where the model takes it (transformers decoders): a
    module run alone would otherwise be handed the cache object the whole eager run has filled."""
    inputs = Inputs.of(inputs)
    if not inputs.kwargs or "use_cache" in inputs.kwargs:
        return inputs
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return inputs
    return Inputs.called(inputs.args, {**inputs.kwargs, "use_cache": False})


def eager_run(target: Target) -> str:
    """How the eager run under the policy is named where it raised."""
    return f"the eager run under {target}"


def measure_compiled(
    model: nn.Module, options: CompileOptions, inputs: Inputs, target: Target, mode: str
) -> CompiledMeasurement:
    """The eager and float32 runs recorded (forward), then the walk of compiled modules."""
    inputs = _without_cache(model, inputs)
    low_model = prepared(model, target, mode)
    f32 = parse_target("32-true")
    ref_model = prepared(model, f32, mode)
    # the model's own error in either run: the caller reports the audit's diagnosis of it
    with raised_in(reference_run(f32), f32.full_policy):
        ref, dirs = record(ref_model, inputs, "eval", None, 0)
    with raised_in(eager_run(target), target.full_policy):
        low, _ = record(low_model, inputs, "eval", dirs, 0)
    if not low.calls:
        return CompiledMeasurement((), None, 0)
    refs = {low_call.index: ref_call for low_call, ref_call in _pair_calls(ref, low)}
    with _Session(options).open() as session:
        rows, first = _walk(session, low, refs)
        if first is not None:
            emulated = _emulated(session, low, first)
            rows = [emulated if r is first else r for r in rows]
            first = emulated
    return CompiledMeasurement(tuple(rows), first, session.compiles)
