"""Tensor and sequence parallel (DTensor ``parallelize_module``) in the distributed audit's view.

A TP plan runs, on each rank, the model on its *local* shards: a ``ColwiseParallel`` Linear holds
``out/tp`` rows and returns ``out/tp`` features, a ``RowwiseParallel`` one takes them and all-reduces
(or reduce-scatters, under sequence parallel) its partial sums, a ``SequenceParallel`` norm runs on
``seq/tp`` positions. The view audits that rank program on plain tensors: every DTensor parameter
becomes a meta tensor of its local shape (the shape FSDP2's all-gather gives back when both are
used), and the styles' DTensor hooks are replaced by hooks doing the same layout changes on plain
tensors: an all-gather is a concatenation along its dim, a reduce-scatter a narrowing, an
all-reduce keeps the shape. Each collective is recorded (module, kind, mesh dim, dtype), so the
report lists the dtypes the collectives run in. Plain tensors keep the audit device-free (a plan
on a "cpu" mesh audits for cuda) and let a float8 policy see the local GEMM dims.

The styles are read from the hooks ``distribute_module`` registered: a lambda closing over the
style's ``partial`` (Colwise/Rowwise/Sequence: layouts as its arguments) or bound method
(PrepareModuleInput/Output: layouts on the style object), and over the mesh.
"""

from __future__ import annotations

import functools
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from castwise._dtypes import short_of

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Layout:
    """One layout change a style makes: ``src`` -> ``dst`` (placements' reprs: ``Shard(dim=1)``,
    ``Replicate()``, ``Partial(sum)``), on the mesh dim ``dim`` of ``size`` ranks."""

    src: Any
    dst: Any


@dataclass(frozen=True)
class Style:
    """What one TP style does at a module's boundary, read from its hooks."""

    name: str  # ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, ...
    mesh_dim: str  # the mesh dim's name ("tp"), or "mesh" when unnamed
    size: int
    inputs: tuple[Layout | None, ...] = ()  # per positional input
    output: Layout | None = None
    kwargs: tuple[tuple[str, Layout], ...] = ()  # per keyword input (PrepareModuleInput's kwarg layouts)


@dataclass
class Collectives:
    """The collectives a view's runs made: (module, kind, mesh dim, dtype) -> calls. Shared by the
    view's copies (the hooks hold it in closures)."""

    calls: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)

    def to_list(self) -> list[dict[str, Any]]:
        return [
            {"module": m or "(root)", "collective": k, "mesh_dim": d, "dtype": t, "calls": n}
            for (m, k, d, t), n in sorted(self.calls.items())
        ]


def is_dtensor(p: Any) -> bool:
    api = sys.modules.get("torch.distributed.tensor")
    return api is not None and isinstance(p, api.DTensor)


def has_tp(model: nn.Module) -> bool:
    """Whether a parameter of ``model`` is a DTensor sharded by a TP mesh dim (not FSDP's alone)."""
    if "torch.distributed.tensor" not in sys.modules or not isinstance(model, torch.nn.Module):
        return False  # not a module: the entry's own check says so
    return any(is_dtensor(p) for p in model.parameters())


def local_shape(shape: torch.Size, mesh: Any, placements: tuple[Any, ...], skip: frozenset[int]) -> tuple[int, ...]:
    """``shape`` on rank 0 after the Shard placements of every mesh dim not in ``skip`` (FSDP's
    own dims, which the all-gather undoes): torch.chunk's sizes, the larger first."""
    out = list(shape)
    for mesh_dim, placement in enumerate(placements):
        if mesh_dim in skip or not placement.is_shard():
            continue
        dim = placement.dim % len(out)
        out[dim] = math.ceil(out[dim] / mesh.size(mesh_dim))
    return tuple(out)


def mesh_title(mesh: Any, fsdp_dims: frozenset[str]) -> str:
    """``FSDP2 x TP8 over 1,024 ranks (dp=128, tp=8)`` for the whole mesh (the root of ``mesh``)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names = root.mesh_dim_names or tuple(f"dim{i}" for i in range(root.ndim))
    sizes = dict(zip(names, root.mesh.shape, strict=True))
    tp = [f"{n.upper()}{s}" for n, s in sizes.items() if n not in fsdp_dims and not _is_dp(n) and s > 1]
    engines = (["FSDP2"] if fsdp_dims else []) + tp
    shape = ", ".join(f"{n}={s}" for n, s in sizes.items())
    return f"{' x '.join(engines) or 'DTensor'} over {root.size():,} ranks ({shape})"


def _is_dp(name: str) -> bool:
    return name.lower() in {"dp", "dp_shard", "dp_replicate", "fsdp", "hsdp", "ddp"}


# -- reading the styles from the hooks -------------------------------------------------------------


def _closure(fn: Any) -> list[Any]:
    cells = getattr(fn, "__closure__", None) or ()
    out = []
    for c in cells:
        try:
            out.append(c.cell_contents)
        except ValueError:  # an empty cell
            continue
    return out


def _mesh_in(values: list[Any]) -> Any:
    mesh_cls = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    return next((v for v in values if mesh_cls is not None and isinstance(v, mesh_cls)), None)


def _style_fn(values: list[Any]) -> tuple[str, str, tuple[Any, ...], Any] | None:
    """(style class, method, partial's arguments, style object) of the function a hook calls."""
    for v in values:
        if isinstance(v, functools.partial):
            func = v.func
            owner = getattr(func, "__self__", None)
            qual = getattr(func, "__qualname__", "")
            cls, _, method = qual.rpartition(".")
            return (type(owner).__name__ if owner is not None else cls, method, tuple(v.args), owner)
        owner = getattr(v, "__self__", None)
        if owner is not None and _is_style(owner):
            return (type(owner).__name__, v.__name__, (), owner)
        if _is_style(v):  # PrepareModuleInput/Output: a lambda closing over the style itself
            return (type(v).__name__, "", (), v)
    return None


def user_style_hook(fn: Any) -> bool:
    """Whether ``fn`` is a hook ``distribute_module`` put on a module to call a style's own
    input_fn / output_fn that is not torch's (an expert-parallel style's token dispatch and
    combine): the view keeps it and runs it on the local tensors, as each rank runs it, where
    torch's styles are replaced by the layout hooks below."""
    if "distribute_module" not in getattr(fn, "__qualname__", ""):
        return False
    for v in _closure(fn):
        func = v.func if isinstance(v, functools.partial) else getattr(v, "__func__", v)
        if callable(func) and _mesh_in([v]) is None and not str(getattr(func, "__module__", "")).startswith("torch."):
            return True
    return False


def _is_style(obj: Any) -> bool:
    style = getattr(sys.modules.get("torch.distributed.tensor.parallel.style"), "ParallelStyle", None)
    return style is not None and isinstance(obj, style)


def _mesh_dim(mesh: Any) -> tuple[str, int]:
    names = getattr(mesh, "mesh_dim_names", None)
    return (names[0] if names else "mesh", int(mesh.size()))


def styles_of(model: nn.Module) -> dict[str, Style]:
    """module name -> the TP style ``parallelize_module`` put on it (read from its hooks)."""
    found: dict[str, Style] = {}
    for name, module in model.named_modules():
        ins: tuple[Layout | None, ...] = ()
        kws: tuple[tuple[str, Layout], ...] = ()
        out: Layout | None = None
        kind, mesh = "", None
        for hook in module._forward_pre_hooks.values():
            values = _closure(hook)
            style, mesh_here = _style_fn(values), _mesh_in(values)
            if style is None or mesh_here is None:
                continue
            kind, mesh = style[0], mesh_here
            ins, kws = _input_layouts(style), _kwarg_layouts(style)
        for hook in module._forward_hooks.values():
            values = _closure(hook)
            style, mesh_here = _style_fn(values), _mesh_in(values)
            if style is None or mesh_here is None:
                continue
            kind, mesh = kind or style[0], mesh or mesh_here
            out = _output_layout(style, module)
        if mesh is not None:
            dim, size = _mesh_dim(mesh)
            found[name] = Style(kind, dim, size, ins, out, kws)
    return found


def _kwarg_layouts(style: tuple[str, str, tuple[Any, ...], Any]) -> tuple[tuple[str, Layout], ...]:
    owner = style[3]
    src = getattr(owner, "input_kwarg_layouts", None) or {}
    dst = getattr(owner, "desired_input_kwarg_layouts", None) or {}
    return tuple((k, Layout(src[k], dst[k])) for k in src if k in dst and src[k] is not None and dst[k] is not None)


def _input_layouts(style: tuple[str, str, tuple[Any, ...], Any]) -> tuple[Layout | None, ...]:
    _cls, _method, args, owner = style
    if owner is not None and hasattr(owner, "desired_input_layouts") and hasattr(owner, "input_layouts"):
        pairs = zip(owner.input_layouts or (), owner.desired_input_layouts or (), strict=False)
        return tuple(None if s is None or d is None else Layout(s, d) for s, d in pairs)
    if len(args) >= 2:  # Colwise/Rowwise: (input_layouts, desired_input_layouts)
        return (Layout(args[0][0], args[1][0]),)
    return ()  # SequenceParallel: the input is taken as already sharded on the sequence


def _output_layout(style: tuple[str, str, tuple[Any, ...], Any], module: nn.Module) -> Layout | None:
    from torch.distributed.tensor import Partial, Shard

    cls, _method, args, owner = style
    if owner is not None and hasattr(owner, "desired_output_layouts"):
        return Layout(owner.output_layouts[0], owner.desired_output_layouts[0])
    if len(args) >= 2 and "Colwise" in cls:  # a Colwise module's output is sharded on its last dim
        return Layout(Shard(-1), args[0][0])
    if len(args) >= 2 and "Rowwise" in cls:  # a Rowwise one's holds partial sums
        return Layout(Partial(), args[0][0])
    return None


# -- the local hooks ----------------------------------------------------------------------------------


def convert(x: Any, layout: Layout | None, size: int, record: Callable[[str, torch.Tensor], None]) -> Any:
    """``x`` (this rank's local tensor) moved from ``layout.src`` to ``layout.dst`` on plain tensors."""
    if layout is None or not isinstance(x, torch.Tensor) or layout.src == layout.dst or size == 1:
        return x
    src, dst = layout.src, layout.dst
    if src.is_shard() and dst.is_replicate():
        record("all-gather", x)
        return torch.cat([x] * size, dim=src.dim)
    if src.is_partial() and dst.is_replicate():
        record("all-reduce", x)
        return x
    if src.is_partial() and dst.is_shard():
        record("reduce-scatter", x)
        return _narrow(x, dst.dim, size)
    if src.is_replicate() and dst.is_shard():
        return _narrow(x, dst.dim, size)  # each rank keeps its chunk: no communication
    if src.is_shard() and dst.is_shard():
        record("all-to-all", x)
        return _narrow(torch.cat([x] * size, dim=src.dim), dst.dim, size)
    return x


def _narrow(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return x.narrow(dim, 0, math.ceil(x.shape[dim] / size))


def install(view: nn.Module, styles: dict[str, Style], seen: Collectives) -> None:
    """Register on ``view`` the plain-tensor hooks doing what each module's style does."""
    for name, style in styles.items():
        module = view.get_submodule(name) if name else view

        def record(kind: str, t: torch.Tensor, name: str = name, style: Style = style) -> None:
            seen.calls[(name, kind, style.mesh_dim, short_of(t.dtype))] += 1

        if style.inputs or style.kwargs:
            module.register_forward_pre_hook(_pre_hook(style, record), with_kwargs=True)
        if style.output is not None:
            module.register_forward_hook(_post_hook(style, record))


def _pre_hook(style: Style, record: Callable[[str, torch.Tensor], None]) -> Callable[..., Any]:
    by_name = dict(style.kwargs)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        args = tuple(
            convert(a, style.inputs[i] if i < len(style.inputs) else None, style.size, record)
            for i, a in enumerate(args)
        )
        return args, {k: convert(v, by_name.get(k), style.size, record) for k, v in kwargs.items()}

    return hook


def _post_hook(style: Style, record: Callable[[str, torch.Tensor], None]) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (convert(out[0], style.output, style.size, record), *out[1:])
        return convert(out, style.output, style.size, record)

    return hook


# -- a model's TP plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorParallel:
    """A model's TP plan as the view needs it: each DTensor parameter's local shape on this rank
    (by ``id``), the styles by module, the collectives its runs record, and the mesh's title."""

    shapes: dict[int, tuple[int, ...]]
    styles: dict[str, Style]
    collectives: Collectives
    title: str
    global_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # param name -> (global, local)


def read(model: nn.Module, fsdp_specs: dict[int, Any]) -> TensorParallel | None:
    """The TP plan of ``model`` (None: no DTensor parameter is TP-sharded). ``fsdp_specs``: for a
    parameter FSDP2 shards, by ``id``, the DTensor spec its all-gather gives back (the TP spec)."""
    if not has_tp(model):
        return None
    shapes: dict[int, tuple[int, ...]] = {}
    named: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    mesh = None
    fsdp_dims: set[str] = set()
    for name, param in model.named_parameters():
        p: Any = param  # a DTensor (device_mesh, placements) where it is sharded
        if id(p) in fsdp_specs:
            spec = fsdp_specs[id(p)]
            if spec is None:  # FSDP2's own sharding alone: the all-gather gives the global shape
                continue
            fsdp_dims |= _fsdp_dim_names(p, spec)
            local = local_shape(p.shape, spec.mesh, tuple(spec.placements), frozenset())
            mesh = mesh or p.device_mesh
        elif is_dtensor(p):
            local = local_shape(p.shape, p.device_mesh, tuple(p.placements), frozenset())
            mesh = mesh or p.device_mesh
        else:
            continue
        shapes[id(p)] = local
        named[name] = (tuple(p.shape), local)
    if mesh is None:
        return None
    return TensorParallel(shapes, styles_of(model), Collectives(), mesh_title(mesh, frozenset(fsdp_dims)), named)


def _fsdp_dim_names(p: Any, spec: Any) -> set[str]:
    """The mesh dims FSDP2 shards ``p`` over: those of its mesh that the TP spec's mesh lacks."""
    names = set(getattr(p.device_mesh, "mesh_dim_names", None) or ())
    tp_names = set(getattr(spec.mesh, "mesh_dim_names", None) or ()) if spec is not None else set()
    return (names - tp_names) or {"dp"}
