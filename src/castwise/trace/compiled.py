"""The compiled-graph producer: torch.compile run for real on the audit's fake copy.

``castwise.audit(torch.compile(model))`` must check what the compiled program runs, and the
dispatch-mode tracer cannot see it: Dynamo does not compile a frame while a dispatch mode is on.
So the compiled run has no tracer. Its copy is compiled with the user's options (``fullgraph``,
``dynamic``) and a backend of castwise's own: AOTAutograd, as ``aot_eager`` does, with compilers
that walk each forward (or inference) and backward ATen graph (``trace.graph``) into the same
:class:`Trace` the tracer makes, and return the graph to run as it is, on the fake tensors.
Between graphs (after a graph break) Dynamo runs the code eagerly, on the same fake tensors.

Nothing of the run outlives it: the compile is isolated (``isolate_recompiles``: it neither
reuses nor counts against the user's cache entries, nor leaves entries the user's model could
hit), and its cache entries are dropped after the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from castwise.devices import Device
from castwise.trace.events import Compiled, GraphBreak, Mode, Prov, Trace
from castwise.trace.graph import GraphWalk
from castwise.trace.tracer import pick_loss


@dataclass(frozen=True)
class CompileOptions:
    """How the user compiled the model (what the audit compiles its copy with)."""

    fullgraph: bool = False
    dynamic: bool | None = None


def compiled_parts(model: nn.Module) -> tuple[nn.Module, CompileOptions] | None:
    """``(the module it compiled, its options)`` for a ``torch.compile``'d module (an
    OptimizedModule), else None. Read without importing torch._dynamo (seconds to import)."""
    if type(model).__name__ != "OptimizedModule" or not isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return None
    ctx = getattr(model, "dynamo_ctx", None)
    dynamic = getattr(ctx, "_dynamic", None)
    options = CompileOptions(bool(getattr(ctx, "fullgraph", False)), dynamic if isinstance(dynamic, bool) else None)
    orig: nn.Module = model._orig_mod
    return orig, options


class CompiledProducer:
    """Makes a compiled run's record (a :class:`castwise.trace.events.Producer`): provenance by
    tensor identity (Dynamo hands its backend the very fake tensors the copy holds), per graph
    by node name. No call raises before dispatch here, so ``refused``/``recent`` are empty."""

    refused: tuple[str, list[torch.Tensor]] | None = None
    recent: Sequence[tuple[str, torch.Tensor]] = ()

    def __init__(self, model: nn.Module, device: Device, autocast: torch.dtype | None, record_ops: bool) -> None:
        self.trace = Trace(kind="compiled")
        known = frozenset(n for n, _m in model.named_modules())
        self.walk = GraphWalk(self.trace, device, known, autocast, record_ops)
        self._provs: dict[int, Prov] = {}
        self._kept: list[torch.Tensor] = []  # the tensors whose ids key _provs stay alive
        self.graphs = 0
        self.backward_graphs = 0
        for mname, module in model.named_modules():
            dot = f"{mname}." if mname else ""
            for kind, store in (("param", module._parameters), ("buffer", module._buffers)):
                for tname, t in store.items():
                    if t is not None and id(t) not in self._provs:
                        self._note(t, Prov(kind, mname, None, f"{kind} {dot}{tname}", t.dtype))  # type: ignore[arg-type]
            for aname, value in vars(module).items():
                if isinstance(value, torch.Tensor) and not aname.startswith("_") and id(value) not in self._provs:
                    self._note(value, Prov("attribute", mname, None, f"tensor attribute {dot}{aname}", value.dtype))

    def _note(self, t: torch.Tensor, prov: Prov) -> None:
        self._provs[id(t)] = prov
        self._kept.append(t)

    def seed_inputs(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            self._note(t, Prov("input", "", None, f"model input `{name}`", t.dtype))

    def prov_of(self, t: torch.Tensor) -> Prov | None:
        return self._provs.get(id(t))

    def backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The Dynamo backend: AOTAutograd with walking compilers (``aot_eager`` that records)."""
        from torch._dynamo.backends.common import aot_autograd

        self.graphs += 1
        seeds = [self.prov_of(t) if isinstance(t, torch.Tensor) else None for t in example_inputs]
        forward: dict[str, Prov | None] = {}

        def fw(fgm: fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
            names = [n.name for n in fgm.graph.nodes if n.op == "placeholder"]
            forward.update(self.walk.walk(fgm, "forward", dict(zip(names, seeds, strict=False))))
            return self._runner(fgm, forward)

        def bw(bgm: fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
            self.backward_graphs += 1
            # saved values keep their forward names; the rest are gradients flowing in
            seeded = {n.name: forward.get(n.name) for n in bgm.graph.nodes if n.op == "placeholder"}
            self.walk.walk(bgm, "backward", seeded)
            return self._runner(bgm, {})

        compiled: Callable[..., Any] = aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, example_inputs)
        return compiled

    def _runner(self, gm: fx.GraphModule, provs: dict[str, Prov | None]) -> Callable[..., Any]:
        """The graph run as it is (boxed: AOTAutograd's calling convention), its outputs' origins
        noted: the code after a graph break receives them as the next graph's inputs."""
        output = next(n for n in gm.graph.nodes if n.op == "output")
        names = [a.name if isinstance(a, fx.Node) else None for a in output.args[0]]

        def run(args: list[Any]) -> Any:
            outs = gm(*args)
            args.clear()
            for o, name in zip(outs, names, strict=False):
                p = provs.get(name) if name is not None else None
                if isinstance(o, torch.Tensor) and p is not None and id(o) not in self._provs:
                    self._note(o, p)
            return outs

        run._boxed_call = True  # type: ignore[attr-defined]
        return run


def _graph_breaks(before: dict[str, int], after: dict[str, int]) -> tuple[GraphBreak, ...]:
    return tuple(GraphBreak(reason, n - before.get(reason, 0)) for reason, n in after.items() if n > before.get(reason, 0))


def _drop_entries(codes: list[Any], region: int) -> None:
    """Drop the cache entries this run's compile left (its own isolated region only). Best
    effort through Dynamo's internals: where they differ, the entries stay, isolated from the
    user's, and are invalidated with the copy they guard."""
    try:
        from torch._C._dynamo.eval_frame import _get_cache_entries_for_region
        from torch._dynamo.guards import DeletedGuardManagerWrapper
    except ImportError:
        return
    for code in dict.fromkeys(codes):
        try:
            for entry in _get_cache_entries_for_region(code, region):
                manager = entry.guard_manager
                extra = getattr(manager, "extra_state", None)
                if extra is not None:
                    extra.invalidate(entry, DeletedGuardManagerWrapper("castwise audit run ended"))
        except (AttributeError, RuntimeError, TypeError):
            continue


def run_compiled(
    producer: CompiledProducer,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: Mode,
    options: CompileOptions,
) -> Trace:
    """Compile ``model`` (the audit's copy) with ``producer``'s backend and run it once in
    ``mode`` ("train": forward + backward; "eval": no_grad). What the model or torch.compile
    raises is recorded (``trace.error``, and its text in ``trace.compiled.error``)."""
    import torch._dynamo
    from torch._dynamo.convert_frame import register_bytecode_hook
    from torch._dynamo.utils import counters

    trace = producer.trace
    before = dict(counters["graph_break"])
    codes: list[Any] = []
    handle = register_bytecode_hook(lambda code, _new: codes.append(code))
    compiled = torch.compile(
        model,
        backend=producer.backend,
        fullgraph=options.fullgraph,
        dynamic=options.dynamic,
        isolate_recompiles=True,
    )
    region = getattr(getattr(compiled, "dynamo_ctx", None), "_isolate_recompiles_id", -1)
    error: str | None = None
    model.train(mode == "train")
    try:
        if mode == "eval":
            with torch.no_grad():
                compiled(*args, **kwargs)
        else:
            with torch.enable_grad():
                out = compiled(*args, **kwargs)
                loss = pick_loss(out)
                if loss is not None:
                    trace.error_phase = "backward"
                    loss.backward()  # type: ignore[no-untyped-call]
    except Exception as exc:  # the model's error, or torch.compile's
        trace.error = exc
        trace.status = "error"
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    finally:
        handle.remove()
        _drop_entries(codes, region)
    if trace.error is None:
        trace.error_phase = "forward"
    if trace.events:
        trace.status = "error"
    trace.compiled = Compiled(
        producer.graphs,
        producer.backward_graphs,
        _graph_breaks(before, dict(counters["graph_break"])),
        options.fullgraph,
        producer.walk.ops,
        error,
    )
    return trace

__all__ = ["CompileOptions", "CompiledProducer", "compiled_parts", "run_compiled"]
