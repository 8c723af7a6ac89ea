"""Pipeline and expert parallel: the rank programs of a mesh, one audit per distinct program.

Under pipeline parallel each rank runs its stage (``PipelineStage.submod``, a ``pipeline()`` split's
or a manual split's, as torchtitan builds one model per stage); under expert parallel each rank of
the EP group holds its own experts. What a rank runs therefore depends on its coordinate along the
``pp`` (or ``ep``) mesh dim; the other dims (dp, tp, cp) run the same program on other data or
other shards, which the FSDP2 / TP view already audits as one. So: one program per coordinate,
programs that are the same (module classes, local parameter shapes and dtypes, what the stage is
handed) audited once, and each finding said for the ranks that run it.

Between programs: a stage's output is sent to the next stage, which receives it into a buffer made
from its declared input (``PipelineStage(input_args=...)``): torch's P2P moves bytes, so a bf16
activation received into an f32 buffer is reinterpreted and half unfilled, without an error
(measured with gloo: tests/distributed/test_programs.py) -> CW174. Collectives a program makes
itself (an MoE layer's all-to-all dispatch/combine, on its own process group) are recorded with
their dtypes at dispatch; one that the programs of a group run in different dtypes, or with
operands of different dtypes, -> CW175.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from castwise._dtypes import fmt_tensor, short_of
from castwise.errors import AuditError
from castwise.report import Finding, Origin

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class RankPrograms:
    """What each coordinate along one mesh dim runs: ``programs[i]`` (an ``nn.Module`` or a
    ``PipelineStage``) on the ranks of ``mesh`` whose ``dim`` coordinate is ``i``. ``mesh``: the
    whole ``DeviceMesh`` (None: read from a DTensor parameter, else a 1-D mesh of the programs)."""

    programs: tuple[Any, ...]
    dim: str = "pp"
    mesh: Any = None


@dataclass(frozen=True)
class Spec:
    """A tensor crossing between programs: its dtype and local shape."""

    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return fmt_tensor(self.dtype, self.shape)


@dataclass(frozen=True)
class Program:
    """One coordinate's program: its module, the ranks running it, what it declares it receives."""

    index: int
    ranks: tuple[int, ...]
    module: nn.Module
    receives: tuple[Spec, ...] | None  # PipelineStage's input_args; None: whatever is sent
    static: bool = False  # PipelineStage given input_args and output_args: no metadata exchanged


@dataclass(frozen=True)
class Layout:
    """The programs along ``dim`` of the mesh and the mesh's title."""

    dim: str
    programs: tuple[Program, ...]
    title: str
    world: int


# set while the per-program audit runs one program: a module recognised as expert parallel by
# its parameters is then that program, not a mesh of programs again
_ONE_PROGRAM: ContextVar[bool] = ContextVar("castwise_one_program", default=False)


@contextlib.contextmanager
def one_program() -> Iterator[None]:
    token = _ONE_PROGRAM.set(True)
    try:
        yield
    finally:
        _ONE_PROGRAM.reset(token)


def expert_mesh(obj: Any) -> Any:
    """The whole mesh of a module holding DTensor parameters sharded over an ``ep`` mesh dim (an
    expert-parallel style's experts, ``[experts, ...]`` sharded on dim 0 by ``distribute_module``);
    None: no such parameter."""
    from torch import nn

    if not isinstance(obj, nn.Module) or "torch.distributed.tensor" not in sys.modules:
        return None
    for p in obj.parameters():
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is None or placements is None:
            continue
        names = tuple(mesh.mesh_dim_names or ())
        if any(n == "ep" and pl.is_shard() for n, pl in zip(names, placements, strict=False)):
            return mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return None


def is_programs(obj: Any) -> bool:
    """Whether ``obj`` is what the per-program audit takes: RankPrograms, a PipelineStage, a
    non-empty list / tuple of PipelineStages, or a module whose experts are sharded over an
    ``ep`` mesh dim (its EP ranks' programs, read from the model itself)."""
    if isinstance(obj, RankPrograms):
        return True
    if not _ONE_PROGRAM.get() and expert_mesh(obj) is not None:
        return True
    if isinstance(obj, (list, tuple)) and obj:
        return all(_is_stage(s) for s in obj)
    return _is_stage(obj)


def _is_stage(obj: Any) -> bool:
    stage = getattr(sys.modules.get("torch.distributed.pipelining.stage"), "_PipelineStageBase", None)
    return stage is not None and isinstance(obj, stage)


def read(obj: Any) -> Layout:
    """The programs of ``obj`` (see ``is_programs``), each with its ranks on the mesh."""
    if isinstance(obj, RankPrograms):
        items, dim, mesh = tuple(obj.programs), obj.dim, obj.mesh
    elif (mesh := expert_mesh(obj)) is not None:
        # every EP rank runs the model on its own experts' shard: one program per ep coordinate
        items, dim = (obj,) * int(mesh.mesh.shape[tuple(mesh.mesh_dim_names).index("ep")]), "ep"
    else:
        stages = sorted(obj if isinstance(obj, (list, tuple)) else [obj], key=lambda s: s.stage_index)
        items, dim, mesh = tuple(stages), "pp", None
    if not items:
        raise AuditError("no rank program to audit: pass one module or PipelineStage per coordinate of the mesh dim")
    modules = [_module_of(x) for x in items]
    mesh = mesh if mesh is not None else _mesh_of(modules)
    grid = _grid(mesh, dim, len(items))
    programs = tuple(
        Program(i, tuple(int(r) for r in grid[i]), m, _receives(x), _static(x))
        for i, (x, m) in enumerate(zip(items, modules, strict=True))
    )
    return Layout(dim, programs, _title(mesh, dim, len(items)), sum(len(p.ranks) for p in programs))


def _module_of(x: Any) -> nn.Module:
    from torch import nn

    module = getattr(x, "submod", x)
    if not isinstance(module, nn.Module):
        raise AuditError(f"a rank program is an nn.Module or a PipelineStage, not {type(x).__name__}")
    return module


def _receives(x: Any) -> tuple[Spec, ...] | None:
    meta = getattr(getattr(x, "_user_meta", None), "inputs", None)
    if not meta:
        return None
    return tuple(Spec(short_of(m.dtype), tuple(int(d) for d in m.shape)) for m in meta)


def _static(x: Any) -> bool:
    meta = getattr(x, "_user_meta", None)
    return bool(getattr(meta, "inputs", None) and getattr(meta, "outputs", None))


def _mesh_of(modules: list[nn.Module]) -> Any:
    for m in modules:
        for p in m.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return None


def _grid(mesh: Any, dim: str, n: int) -> list[list[int]]:
    """Per coordinate along ``dim``: the global ranks whose coordinate it is."""
    if mesh is None:
        return [[i] for i in range(n)]
    names = tuple(mesh.mesh_dim_names or ())
    if dim not in names:
        raise AuditError(f"the mesh has no dim {dim!r}; its dims are {sorted(names)}: pass RankPrograms(dim=...)")
    at = names.index(dim)
    if mesh.mesh.shape[at] != n:
        raise AuditError(f"{n} programs for the mesh dim {dim}={mesh.mesh.shape[at]}: pass one per coordinate")
    ranks = mesh.mesh.movedim(at, 0).reshape(n, -1)
    return [sorted(int(r) for r in row) for row in ranks]


def _title(mesh: Any, dim: str, n: int) -> str:
    if mesh is None:
        return f"{dim.upper()}{n} over {n:,} ranks ({dim}={n})"
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    sizes = dict(zip(names, (int(s) for s in mesh.mesh.shape), strict=True))
    engines = " x ".join(f"{name.upper()}{s}" for name, s in sizes.items() if s > 1)
    shape = ", ".join(f"{name}={s}" for name, s in sizes.items())
    return f"{engines} over {int(mesh.size()):,} ranks ({shape})"


def signature(module: nn.Module, receives: tuple[Spec, ...] | None) -> tuple[Any, ...]:
    """What makes two programs the same: module classes in order with their dtype and flag
    attributes (a stage told to return f32), parameters' and buffers' local shapes (DTensors: their
    placements too) and dtypes, and what the program is handed. Names and counters are left out
    (stage 3's ``layers.24`` is stage 2's ``layers.16``; HF's ``layer_idx``)."""
    mods = tuple((type(m).__name__, n.count("."), _settings(m)) for n, m in module.named_modules())
    params = tuple(
        (tuple(p.shape), p.dtype, repr(getattr(p, "placements", None)), p.requires_grad) for p in module.parameters()
    )
    buffers = tuple((tuple(b.shape), b.dtype) for b in module.buffers())
    return mods, params, buffers, receives


def _settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """A module's own attributes that choose dtypes or paths: dtypes, bools, strings (not ints:
    layer indices differ between the same programs)."""
    return tuple(
        (k, v)
        for k, v in sorted(module.__dict__.items())
        if not k.startswith("_") and (isinstance(v, (bool, str, torch.dtype)) or v is None)
    )


def spec_of(text: str) -> Spec | None:
    """``bf16[2, 4]`` (the audit's summary) as a Spec."""
    dtype, _, rest = text.partition("[")
    if not rest.endswith("]"):
        return None
    dims = rest[:-1].strip()
    return Spec(dtype, tuple(int(d) for d in dims.split(",")) if dims else ())


def ranks_text(ranks: Sequence[int]) -> str:
    """``ranks 0-7`` / ``ranks 8, 24, 40 ... (64 ranks)``: short, exact for a run of ranks."""
    r = sorted(ranks)
    if len(r) == 1:
        return f"rank {r[0]}"
    if r == list(range(r[0], r[-1] + 1)):
        return f"ranks {r[0]}-{r[-1]}"
    shown = ", ".join(str(x) for x in r[:3])
    return f"ranks {shown} ... ({len(r)} ranks)" if len(r) > 3 else f"ranks {shown}"


# -- collectives a program makes ----------------------------------------------------------------------


@dataclass
class Collectives:
    """The c10d collectives a program's runs made: (module, collective, its n-th of that kind in the
    module's run, operand dtypes) -> calls. The ordinal tells a dispatch from a combine."""

    calls: dict[tuple[str, str, int, tuple[str, ...]], int] = field(default_factory=dict)

    def to_list(self) -> list[dict[str, Any]]:
        return [
            {"module": m or "(root)", "collective": k, "call": i, "dtype": "/".join(dict.fromkeys(d)), "calls": n}
            for (m, k, i, d), n in sorted(self.calls.items())
        ]


_KINDS = {
    "alltoall": "all-to-all",
    "allgather": "all-gather",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "allreduce": "all-reduce",
    "all_reduce": "all-reduce",
    "broadcast": "broadcast",
    "send": "send",
    "recv": "recv",
}


def _kind(op: str) -> str:
    return next((k for key, k in _KINDS.items() if key in op), op)


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records each c10d op (with its module, from ``stack``) and its floating operands' dtypes."""

    def __init__(self, seen: Collectives, stack: list[str], nth: dict[tuple[str, str], int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen, self.stack, self.nth = seen, stack, nth

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            dtypes = tuple(short_of(t.dtype) for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())
            if dtypes:
                module, kind = self.stack[-1] if self.stack else "", _kind(func.name())
                n = self.nth[(module, kind)] = self.nth.get((module, kind), 0) + 1
                key = (module, kind, n, dtypes)
                self.seen.calls[key] = self.seen.calls.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording(seen: Collectives) -> Iterator[None]:
    """Record the collectives of the runs inside (module names relative to the root called first);
    the global module hooks it needs are removed after, also when the run raises."""
    from torch.nn.modules import module as module_mod

    stack: list[str] = []
    names: dict[int, str] = {}
    nth: dict[tuple[str, str], int] = {}

    def pre(module: nn.Module, args: Any) -> None:
        if not stack:  # a run's root: name every module it holds, count its calls afresh
            nth.clear()
            if id(module) not in names:
                names.clear()
                names.update({id(m): n for n, m in module.named_modules()})
        stack.append(names.get(id(module), stack[-1] if stack else ""))

    def post(module: nn.Module, args: Any, out: Any) -> None:
        if stack:
            stack.pop()

    handles = [module_mod.register_module_forward_pre_hook(pre), module_mod.register_module_forward_hook(post)]
    try:
        with _Recorder(seen, stack, nth):
            yield
    finally:
        for h in handles:
            h.remove()


# -- findings between programs -----------------------------------------------------------------------


def p2p_findings(
    layout: Layout, sent: dict[int, tuple[Spec, ...]], receiver_module: dict[int, str], modes: tuple[Any, ...]
) -> list[Finding]:
    """A CW174 error per stage input whose declared receive buffer differs from what the stage
    before sends into it: ``sent[i]``, stage i's outputs as its audit computed them (a tuple
    sends each tensor into the next stage's buffer of the same position)."""
    found: list[Finding] = []
    for prev, nxt in itertools.pairwise(layout.programs):
        outs, want = sent.get(prev.index, ()), nxt.receives or ()
        if not outs or not want:
            continue
        for at, (out, buf) in enumerate(itertools.zip_longest(outs, want)):
            if out != buf:
                found.append(_cw174(prev, nxt, at, (out, buf), (len(outs), len(want)), receiver_module, modes))
    return found


def _cw174(
    prev: Program,
    nxt: Program,
    at: int,
    pair: tuple[Spec | None, Spec | None],
    counts: tuple[int, int],
    receiver_module: dict[int, str],
    modes: tuple[Any, ...],
) -> Finding:
    out, buf = pair
    first = receiver_module.get(nxt.index, "")
    many = max(counts) > 1
    sends = f"{out} as output {at}" if many and out is not None else str(out)
    into = f"input_args[{at}] {buf}" if many else f"{buf} (PipelineStage input_args)"
    if out is None or buf is None:  # one end has more tensors than the other
        what = "tensor count"
        head = (
            f"Pipeline stage {prev.index} ({ranks_text(prev.ranks)}) sends {counts[0]} tensors to stage "
            f"{nxt.index} ({ranks_text(nxt.ranks)}), which declares {counts[1]} receive buffers "
            f"(PipelineStage input_args): "
        )
    else:
        what = "dtype" if out.dtype != buf.dtype else "shape"
        head = (
            f"Pipeline stage {prev.index} ({ranks_text(prev.ranks)}) sends {sends} to stage {nxt.index} "
            f"({ranks_text(nxt.ranks)}), whose receive buffer is {into}: "
        )
    tail = (
        f"with input_args and output_args given nothing exchanges metadata and the send/recv moves bytes, "
        f"so stage {nxt.index} computes on the bits of another tensor, silently."
        if nxt.static
        else f"stage {nxt.index} raises PipeliningMetadataError ('{what} mismatch') at its first step, on its "
        "ranks only, while the other stages wait on it."
    )
    fix = (
        f"Declare stage {nxt.index}'s input_args as {out} (what stage {prev.index} computes), or cast stage "
        f"{prev.index}'s output to {buf.dtype} before it returns (so both ends agree)."
        if out is not None and buf is not None
        else f"Declare one input_args tensor per tensor stage {prev.index} returns ({counts[0]})."
    )
    return Finding(
        code="CW174",
        message=head + tail,
        module=first,
        origin=Origin(
            first or None, None, f"input{f' {at}' if many else ''} of stage {nxt.index} (recv from stage {prev.index})"
        ),
        modes=modes,
        fix=fix,
        details=(
            ("collective", "send/recv"),
            ("send", str(out)),
            ("recv", str(buf)),
            ("input", at),
            ("stages", [prev.index, nxt.index]),
            ("ranks", list(nxt.ranks)),
        ),
    )


def collective_findings(
    by_program: list[tuple[Program, Collectives]], dim: str, modes: tuple[Any, ...]
) -> list[Finding]:
    """CW175 errors: a collective whose operands differ in dtype within one call, or that the
    programs of the group run in different dtypes (experts kept in f32 on one EP rank)."""
    found: list[Finding] = []
    across: dict[tuple[str, str, int], dict[tuple[str, ...], list[Program]]] = {}
    for program, seen in by_program:
        for (module, kind, nth, dtypes), _n in seen.calls.items():
            across.setdefault((module, kind, nth), {}).setdefault(dtypes, []).append(program)
            if len(set(dtypes)) > 1:
                found.append(_cw175(module, (kind, nth), [program], dtypes, modes, within=True))
    for (module, kind, nth), variants in sorted(across.items()):
        uniform = {d for d in variants if len(set(d)) == 1}
        if len(uniform) > 1:
            # the odd dtype: on fewer ranks; on a tie the wider one (a module left out of the cast)
            order = sorted(uniform, key=lambda d: (sum(len(p.ranks) for p in variants[d]), -_WIDTH.get(d[0], 0)))
            odd, usual = order[0], order[-1]
            found.append(_cw175(module, (kind, nth), variants[odd], (*odd[:1], *usual[:1]), modes, False, dim))
    return list({(f.module, f.message): f for f in found}.values())  # once, whatever the modes


_WIDTH = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2}


def _cw175(
    module: str,
    call: tuple[str, int],
    programs: list[Program],
    dtypes: tuple[str, ...],
    modes: tuple[Any, ...],
    within: bool,
    dim: str = "",
) -> Finding:
    ranks = sorted(r for p in programs for r in p.ranks)
    kind, nth = call
    where = f"`{module}`" if module else "the root"
    where = f"{where} (its call {nth} of {kind})" if nth > 1 else where
    shown = " and ".join(dict.fromkeys(dtypes))
    if within:
        message = (
            f"The {kind} in {where} ({ranks_text(ranks)}) has operands in {shown}: torch.distributed refuses "
            f"collectives whose tensors differ in dtype (c10d: 'Invalid usage of tensors with different dtypes'; "
            f"gloo: 'Check failed: outputTensors[i].dtype() == inputTensors[i].dtype()')."
        )
        fix = f"Allocate the {kind}'s output buffer in the input's dtype (torch.empty_like(x)), cast after it."
    else:
        message = (
            f"The {kind} in {where} runs in {dtypes[0]} on {dim}={','.join(str(p.index) for p in programs)} "
            f"({ranks_text(ranks)}) but in {dtypes[1]} on the other ranks of its group: a collective moves "
            "bytes, so the ranks read each other's tensors as the wrong dtype (or the sizes disagree), on "
            "ranks the rank-0 audit never sees."
        )
        fix = (
            f"Keep `{module}` in {dtypes[1]} on every rank of the {dim} group (the same .to(dtype) on each "
            f"rank's experts), or cast to {dtypes[1]} before the {kind}."
        )
    return Finding(
        code="CW175",
        message=message,
        module=module,
        origin=Origin(module or None, None, f"{kind} on {ranks_text(ranks)}"),
        modes=modes,
        fix=fix,
        details=(("collective", kind), ("dtypes", list(dict.fromkeys(dtypes))), ("ranks", ranks)),
    )
