"""The compiled-graph producer: torch.compile run for real on the audit's fake copy.

``castwise.audit(torch.compile(model))`` must check what the compiled program runs, and the
dispatch-mode tracer cannot see it: Dynamo does not compile a frame while a dispatch mode is on.
So the compiled run has no tracer. Its copy is compiled with the user's options (``fullgraph``,
``dynamic``) and a backend of castwise's own: AOTAutograd, as ``aot_eager`` does, with compilers
that walk each forward (or inference) and backward ATen graph (``trace.graph``) into the same
:class:`Trace` the tracer makes, and return the graph to run as it is, on the fake tensors. For
an Inductor program (torch.compile's default) AOTAutograd traces with Inductor's decomposition
table, so the graphs walked are the ops Inductor lowers, in the dtypes its decompositions give.
Between graphs (after a graph break) Dynamo runs the code eagerly, on the same fake tensors.

Nothing of the run outlives it: the compile is isolated where torch can (``isolate_recompiles``: it
counts against no limit of the user's), and its cache entries are dropped after the run.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import re
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from castwise._compiled import CompileOptions, compiled_parts
from castwise._paths import short_path
from castwise.devices import Device
from castwise.trace import provenance
from castwise.trace.events import Compiled, GraphBreak, Mode, Phase, Prov, Trace
from castwise.trace.graph import GraphWalk, autocast_regions
from castwise.trace.observers import pick_loss
from castwise.trace.record import Recorder
from castwise.trace.simcuda import host_has_cuda


class CompiledProducer:
    """Makes a compiled run's record (a :class:`castwise.trace.events.Producer`): provenance by
    tensor identity (Dynamo hands its backend the very fake tensors the copy holds), per graph
    by node name. No call raises before dispatch here, so ``refused``/``recent`` are empty."""

    refused: tuple[str, list[torch.Tensor]] | None = None
    recent: Sequence[tuple[str, torch.Tensor]] = ()

    def __init__(self, model: nn.Module, device: Device, autocast: torch.dtype | None, record_ops: bool) -> None:
        self.recorder = Recorder(Trace(kind="compiled"), record_ops=record_ops)
        self.trace = self.recorder.trace
        known = frozenset(n for n, _m in model.named_modules())
        self.walk = GraphWalk(self.recorder, device, known, autocast)
        self._provs: dict[int, Prov] = {}
        self._kept: list[torch.Tensor] = []  # the tensors whose ids key _provs stay alive
        self.graphs = 0
        self.backward_graphs = 0
        # the decomposition table the graphs are traced with: Inductor's for an Inductor program
        # (its decompositions can change an op's dtypes: addmm of one row into f32 mul + sum)
        self.decompositions: dict[Any, Any] | None = None
        self.breaks: list[tuple[str, str | None]] = []  # (reason, user's line) Dynamo gave the backend
        for t, p in provenance.seeds(model):
            self._note(t, p)

    def _note(self, t: torch.Tensor, prov: Prov) -> None:
        self._provs[id(t)] = prov
        self._kept.append(t)

    def seed_inputs(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            self._note(t, provenance.model_input(name, t))

    def prov_of(self, t: torch.Tensor) -> Prov | None:
        return self._provs.get(id(t))

    def backend_for(self, block: str) -> Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]:
        """The backend for the graphs of module ``block`` compiled on its own (their module paths
        start at it); ``""``: the whole model's."""

        def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            return self.backend(gm, example_inputs, block)

        return backend

    def backend(self, gm: fx.GraphModule, example_inputs: list[Any], block: str = "") -> Callable[..., Any]:
        """The Dynamo backend: AOTAutograd with walking compilers (``aot_eager`` that records)."""
        from torch._dynamo.backends.common import aot_autograd

        self.graphs += 1
        why = getattr(gm, "compile_subgraph_reason", None)
        if why is not None and getattr(why, "graph_break", False):
            stack = list(getattr(why, "user_stack", None) or [])
            at = f"{short_path(stack[-1].filename)}:{stack[-1].lineno}" if stack else None
            self.breaks.append((_reason(str(why.reason)), at))
        seeds = [self.prov_of(t) if isinstance(t, torch.Tensor) else None for t in example_inputs]
        forward: dict[str, Prov | None] = {}
        regions = autocast_regions(gm, self.walk.device.autocast_type)

        def fw(fgm: fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
            names = [n.name for n in fgm.graph.nodes if n.op == "placeholder"]
            self.walk.regions = regions
            self.walk.prefix = block
            forward.update(self.walk.walk(fgm, "forward", dict(zip(names, seeds, strict=False))))
            return self._runner(fgm, forward)

        def bw(bgm: fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
            self.backward_graphs += 1
            # saved values keep their forward names; the rest are gradients flowing in
            seeded = {n.name: forward.get(n.name) for n in bgm.graph.nodes if n.op == "placeholder"}
            self.walk.prefix = block
            self.walk.walk(bgm, "backward", seeded)
            return self._runner(bgm, {})

        table = self.decompositions or {}  # an empty table: AOTAutograd's own (as aot_eager)
        compiled: Callable[..., Any] = aot_autograd(fw_compiler=fw, bw_compiler=bw, decompositions=table)(
            gm, _in_dynamo_mode(example_inputs)
        )
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


def _in_dynamo_mode(example_inputs: list[Any]) -> list[Any]:
    """The example inputs, the audit's fake tensors among them copied into the fake mode Dynamo
    traces the graph in (its tracing context's): Dynamo hands its backend the very tensors it was
    called with, and AOTAutograd traces in the context's mode. Newer torch copies a fake tensor of
    another mode itself (2.14: torch/_functorch/_aot_autograd/frontend_utils.py, ``process_inputs``:
    ``fake_mode.from_tensor(x)``); 2.10 asserts that there is one mode (torch/_guards.py,
    ``detect_fake_mode``). The copy is the same on both; the graph still runs on the audit's own."""
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensor, get_plain_tensors
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    context = TracingContext.try_get()
    mode = context.fake_mode if context is not None else None
    if mode is None:
        return example_inputs

    def foreign(t: torch.Tensor) -> bool:
        inner: list[Any] = get_plain_tensors(t, out=[]) if is_traceable_wrapper_subclass(t) else [t]
        return any(isinstance(x, FakeTensor) and x.fake_mode is not mode for x in inner)

    return [mode.from_tensor(x) if isinstance(x, torch.Tensor) and foreign(x) else x for x in example_inputs]


_BREAK_LOG = "torch._dynamo.symbolic_convert.__graph_breaks"
_BREAK_AT = re.compile(r"in user code at (.+?):(\d+)")
_BREAK_REASON = re.compile(r"Graph Break Reason: (.*)")


def _reason(text: str) -> str:
    """A break's reason in a line: Dynamo's first line, and the next where the first only says
    that a break was met ("... Graph break encountered:")."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "(Dynamo recorded no reason)"
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


class _BreakLog(logging.Handler):
    """Dynamo's graph-break log, read while the compiled run runs: each break's reason and the
    user's line, also for a break Dynamo met before in this process (its own counters and
    warnings count a break once per process)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.breaks: dict[tuple[str, str | None], int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        reason = _BREAK_REASON.search(text)
        at = _BREAK_AT.search(text)
        where = f"{short_path(at.group(1))}:{at.group(2)}" if at else None
        key = (_reason(text[reason.start(1) :] if reason else text), where)
        self.breaks[key] = self.breaks.get(key, 0) + 1

    def found(self, producer: CompiledProducer) -> tuple[GraphBreak, ...]:
        """The breaks logged, and those Dynamo named to the backend that it did not log."""
        found = dict(self.breaks)
        for key in producer.breaks:
            if not any(where == key[1] for _r, where in found):
                found[key] = found.get(key, 0) + 1
        if not found and producer.graphs > 1:  # graphs split where Dynamo gave no reason
            found[("(Dynamo recorded no reason)", None)] = producer.graphs - 1
        return tuple(GraphBreak(reason, n, where) for (reason, where), n in found.items())


@contextlib.contextmanager
def _reading_breaks() -> Iterator[_BreakLog]:
    """The graph-break log routed to a :class:`_BreakLog` alone (nothing printed), restored after."""
    log = logging.getLogger(_BREAK_LOG)
    saved = (log.level, list(log.handlers), log.propagate, log.disabled)
    handler = _BreakLog()
    log.handlers = [handler]
    log.setLevel(logging.DEBUG)
    log.propagate = False
    log.disabled = False
    try:
        yield handler
    finally:
        log.setLevel(saved[0])
        log.handlers = saved[1]
        log.propagate = saved[2]
        log.disabled = saved[3]


class _Entries:
    """The cache entries a run's compile adds, dropped after it: the user's code objects (their
    ``forward``) hold Dynamo's entries of every compile, the user's own included. Where the
    compile is isolated (``isolate_recompiles``, torch >= 2.13) every entry of its region is the
    run's; else those a code object did not have when Dynamo first compiled it in this run.
    Best effort through Dynamo's internals: where they differ, the entries stay, and fail their
    guards on anything but the run's fake tensors."""

    def __init__(self, *regions: int) -> None:
        # one region per compile call (a model compiled block by block makes several); -1: none
        self.regions = list(regions) if regions and all(r >= 0 for r in regions) else []
        self.region = 0 if self.regions else -1
        self.before: dict[Any, set[int]] = {}

    def _of(self, code: Any) -> list[Any]:
        from torch._C._dynamo import eval_frame

        if self.regions:
            return [e for r in self.regions for e in eval_frame._get_cache_entries_for_region(code, r)]
        return list(eval_frame._debug_get_cache_entry_list(code))

    def hook(self, code: types.CodeType, new_code: types.CodeType) -> types.CodeType | None:
        """Dynamo's bytecode hook: called before each new entry of ``code`` is stored."""
        if code not in self.before:
            self.before[code] = set() if self.region >= 0 else {id(e) for e in self._of(code)}
        return None  # the compiled code as Dynamo made it

    def drop(self) -> None:
        try:
            from torch._dynamo.guards import DeletedGuardManagerWrapper
        except ImportError:
            return
        from torch._C._dynamo import eval_frame

        for code, before in self.before.items():
            try:
                for entry in self._of(code):
                    extra = getattr(entry.guard_manager, "extra_state", None)
                    if id(entry) not in before and extra is not None:
                        extra.invalidate(entry, DeletedGuardManagerWrapper("castwise audit run ended"))
                if not before and self.region < 0:
                    # torch 2.12: invalidating one entry does not take; a code object that had none before the
                    # run holds only the run's, so all go (else the next audit would reuse them and
                    # compile nothing)
                    eval_frame.reset_code(code)
            except (AttributeError, RuntimeError, TypeError):
                continue


_WARM: list[bool] = []

NO_ENGINE = (
    "on the simulated CUDA device without a GPU on this machine: AOTAutograd traces a backward by "
    "running the autograd engine, which needs a CUDA context (the eager run checked the backward)"
)


def warm_up() -> None:
    """Build Dynamo's per-process tables (which torch function is handled how, keyed by the
    function objects) before an audit patches any of them: built first under the simulated CUDA
    device, they would be keyed by its stand-ins (and refuse two names for one of them), and
    every later compile in the process would miss ``torch.cuda``'s real functions. Inductor's
    decompositions are imported here too, before any patching. Done once, on a function of its
    own, whose cache entry dies with it."""
    if _WARM:
        return
    import torch._dynamo
    import torch._inductor.decomposition  # its import reads the device: never under the simulated one

    def warm(x: torch.Tensor) -> torch.Tensor:
        return torch.add(x, 1)

    torch.compile(warm, backend="eager")(torch.zeros(1))
    _WARM.append(True)


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

    trace = producer.trace
    if options.inductor:
        from torch._inductor.decomposition import select_decomp_table

        producer.decompositions = select_decomp_table()
    # isolated where torch can (>= 2.13): neither counted against the user's recompile limit
    # nor stored beside the user's entries
    # torch.compile itself, not a wrapper another library put over it (Lightning Fabric's deep-copies
    # the keyword arguments, which our backend, holding the producer, cannot be)
    compile_fn = inspect.unwrap(torch.compile)
    isolate: dict[str, Any] = (
        {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(compile_fn).parameters else {}
    )
    kw: dict[str, Any] = {"fullgraph": options.fullgraph, "dynamic": options.dynamic, **isolate}
    if options.blocks:  # compiled block by block: the rest of the model runs eagerly between them
        compiled = model
        regions = [_compile_block(compile_fn, model, b, producer.backend_for(b), kw) for b in options.blocks]
    else:
        compiled = compile_fn(model, backend=producer.backend, **kw)
        regions = [getattr(getattr(compiled, "dynamo_ctx", None), "_isolate_recompiles_id", -1)]
    entries = _Entries(*regions)
    handle = register_bytecode_hook(entries.hook)
    model.train(mode == "train")
    simulated = producer.walk.device.kernels == "cuda" and not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    # AOTAutograd traces the backward by running the autograd engine on the fake tensors, and the
    # engine asks the CUDA runtime about the device's context (this machine has no GPU): the train
    # run's forward graphs are traced under no_grad there, the eager run checks the backward
    untraced = NO_ENGINE if simulated and mode == "train" and not host_has_cuda() else None
    try:
        with (
            _reading_breaks() as breaks,
            _off_the_host_device() if simulated else contextlib.nullcontext(),
            _old_objects_frozen(),
        ):
            error = _call(compiled, args, kwargs, mode, producer.recorder, backward=untraced is None)
    finally:
        handle.remove()
        entries.drop()
    producer.recorder.ended(
        Compiled(
            producer.graphs,
            producer.backward_graphs,
            breaks.found(producer),
            options.fullgraph,
            producer.walk.ops,
            error,
            "inductor" if producer.decompositions is not None else None,
            untraced,
        )
    )
    return trace


def _compile_block(
    compile_fn: Callable[..., Any], model: nn.Module, name: str, backend: Callable[..., Any], kw: dict[str, Any]
) -> int:
    """Compile the copy's module ``name`` in place, as ``nn.Module.compile`` does (its call
    compiled, its name and place in the tree kept); the compile's region id (-1: not isolated)."""
    block = model.get_submodule(name)
    fn = compile_fn(block._call_impl, backend=backend, **kw)
    block._compiled_call_impl = fn
    cells = getattr(fn, "__closure__", None) or ()
    ctx = next((c.cell_contents for c in cells if hasattr(c.cell_contents, "_isolate_recompiles_id")), None)
    region: int = getattr(ctx, "_isolate_recompiles_id", -1)
    return region


@contextlib.contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """The objects alive before the compile left out of the garbage collector's full passes while
    it runs: Dynamo and AOTAutograd allocate enough to set off several, each walking every object
    of the process (the audit's copies, the user's model) for none of the compile's garbage
    (measured: 14-21% of a compiled audit). Left alone where the process froze objects itself:
    unfreezing would release its own."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _off_the_host_device() -> Iterator[None]:
    """On the simulated CUDA device, where this machine has none, two things torch.compile does
    would reach the CUDA runtime. Dynamo asks the accelerator for its current stream when it
    starts tracing a frame (to track stream use): it is told there is no accelerator (the
    simulated device answers the model's own questions, ``torch.cuda.*``, as before). AOTAutograd's
    tracer (``make_fx``) computes ops on small constant tensors for real to keep their values: a
    ``torch.tensor(data, device="cuda")`` in the model is such a constant moved to the device, so
    that propagation is off (no constant is small enough)."""
    from torch.fx.experimental import proxy_tensor

    saved = torch.accelerator.is_available
    limit = proxy_tensor.CONSTANT_NUMEL_LIMIT
    torch.accelerator.is_available = lambda: False
    proxy_tensor.CONSTANT_NUMEL_LIMIT = -1
    try:
        yield
    finally:
        torch.accelerator.is_available = saved
        proxy_tensor.CONSTANT_NUMEL_LIMIT = limit


def _call(
    compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mode: Mode, recorder: Recorder, backward: bool = True
) -> str | None:
    """One call (and backward in train mode, unless not ``backward``: the train-mode forward under
    no_grad); what it raised is recorded."""
    phase: Phase = "forward"
    try:
        if mode == "eval" or not backward:
            with torch.no_grad():
                compiled(*args, **kwargs)
        else:
            with torch.enable_grad():
                out = compiled(*args, **kwargs)
                loss = pick_loss(out)
                if loss is not None:
                    phase = "backward"
                    loss.backward()  # type: ignore[no-untyped-call]
    except Exception as exc:  # the model's error, or torch.compile's
        recorder.raised(exc, [], phase)
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return None


__all__ = ["CompileOptions", "CompiledProducer", "compiled_parts", "run_compiled", "warm_up"]
