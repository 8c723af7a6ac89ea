"""The audit's scale-only findings: what goes wrong only once a plan is sharded over a mesh.

CW170: a Linear whose global dims suit the policy's float8 / MX GEMM while its TP-local shard
does not (the conversion filters see the module before ``parallelize_module``; each rank's
``torch._scaled_mm`` then meets the local dims).
CW171: torchao's float8 all-gather of an FSDP2 parameter whose sharded dim does not divide by the
shard group (torchao#3982). CW172: an FSDP2 unit's ``cast_forward_inputs`` narrowing a floating
position / phase table passed to its forward. CW173: a Float8 TP style returning a DTensor
(``use_local_output=False``), whose float8 casts then take the amax of the TP-local shard
(torchtitan#3109).
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from castwise._dtypes import short_of
from castwise.policy import Policy
from castwise.report import Finding, Origin

if TYPE_CHECKING:
    import torch
    from torch import nn

    from castwise.distributed.tp import TensorParallel


def tp_gemm_findings(
    model: nn.Module, tensor_parallel: TensorParallel, policy: Policy | str | None, modes: tuple[Any, ...]
) -> list[Finding]:
    """A CW170 error per TP-sharded Linear whose local dims break the policy's low-precision GEMM."""
    from torch import nn

    from castwise.float8.scaling import multiple

    recipe = Policy.parse(policy).float8 if policy is not None else None
    if recipe is None:
        return []
    k = multiple(recipe)
    found: list[Finding] = []
    for name, module in model.named_modules():
        shapes = tensor_parallel.global_shapes.get(f"{name}.weight" if name else "weight")
        if not isinstance(module, nn.Linear) or shapes is None:
            continue
        whole, local = shapes
        if any(d % k for d in whole) or not any(d % k for d in local):
            continue
        style = tensor_parallel.styles.get(name)
        how = f" ({style.name} over {style.mesh_dim}={style.size})" if style is not None else ""
        found.append(
            Finding(
                code="CW170",
                message=(
                    f"`{name}` ({recipe.scaling} float8 GEMM) has weight dims {whole}, multiples of {k}, but "
                    f"tensor parallel{how} leaves each rank {local}: torch._scaled_mm refuses dims that are "
                    f"not multiples of {k} on every rank, while the unsharded model runs."
                ),
                module=name,
                origin=Origin(name or None, None, f"param {name}.weight"),
                modes=modes,
                fix=(
                    f"Shard `{name}` so each rank keeps a multiple of {k} (a TP degree dividing "
                    f"{max(whole)} // {k}), pad it (Float8LinearConfig(pad_inner_dim=True)), or leave it out "
                    f"of float8 (keep[{name}]=bf16, torchtitan filter_fqns)."
                ),
            )
        )
    return found


def fp8_gather_findings(model: nn.Module, gathered: list[tuple[str, Any]], modes: tuple[Any, ...]) -> list[Finding]:
    """A CW171 error per FSDP2 parameter torchao all-gathers in float8 (its local tensor is a
    ``WeightWithDynamicFloat8CastTensor``) whose sharded dim does not divide by the shard group:
    ``gathered`` holds (unit, FSDPParam) pairs."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    found: list[Finding] = []
    for _unit, fp in gathered:
        p = fp.sharded_param
        if type(getattr(p, "_local_tensor", p)).__name__ != "WeightWithDynamicFloat8CastTensor":
            continue
        info = fp.mesh_info
        world = int(info.mesh.size(info.shard_mesh_dim) if info.shard_mesh_dim is not None else info.mesh.size())
        dim = fp.fsdp_placement.dim % p.ndim if hasattr(fp, "fsdp_placement") else 0
        size = int(p.shape[dim])
        if world <= 1 or size % world == 0:
            continue
        name = names.get(id(p), "?")
        owner = name.rpartition(".")[0]
        found.append(
            Finding(
                code="CW171",
                message=(
                    f"`{name}` {tuple(p.shape)} is all-gathered in float8 (torchao enable_fsdp_float8_all_gather) "
                    f"over {world} ranks, but its dim {dim} ({size}) does not divide by {world}: FSDP2 pads the "
                    f"last shards, and torchao's float8 all-gather of the padded, uneven shards fails or "
                    f"gathers a wrong weight (torchao#3982), while a bf16 all-gather of the same weight runs."
                ),
                module=owner,
                origin=Origin(owner or None, None, f"param {name}"),
                modes=modes,
                fix=(
                    f"Make dim {dim} of `{name}` a multiple of {world} (pad the layer, or a shard group dividing "
                    f"{size}), leave `{owner}` out of the float8 conversion (module_filter_fn), or all-gather in "
                    "high precision (enable_fsdp_float8_all_gather=False)."
                ),
            )
        )
    return found


# a position or phase table by its argument's name: freqs_cis, rope_cache, position_embeddings, pos, cos/sin
_TABLE = re.compile(r"freq|rope|rotary|posit|phase|theta|angle|(^|_)(pos|cos|sin)(_|s?$)", re.IGNORECASE)


def note_tables(
    narrowed: dict[tuple[str, str], tuple[str, tuple[int, ...], str]],
    unit: str,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    to: torch.dtype,
) -> None:
    """Record the floating position tables among a unit's forward inputs that its input cast
    (to ``to``) narrows: named by the forward's parameter (or the keyword) they are passed as."""
    import torch

    try:
        params = [n for n in inspect.signature(forward).parameters][1:]  # without self
    except (TypeError, ValueError):
        params = []
    named = [(params[i] if i < len(params) else f"arg{i}", a) for i, a in enumerate(args)]

    def visit(name: str, value: Any) -> None:
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                visit(f"{name}[{i}]", v)
        elif (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.dtype.itemsize > to.itemsize == 2  # into bf16 / f16
            and _TABLE.search(name.partition("[")[0])
        ):
            narrowed[(unit, name)] = (short_of(value.dtype), tuple(value.shape), short_of(to))

    for name, value in [*named, *kwargs.items()]:
        visit(name, value)


def table_findings(
    narrowed: dict[tuple[str, str], tuple[str, tuple[int, ...], str]], modes: tuple[Any, ...]
) -> list[Finding]:
    """A CW172 warning per (unit, input) whose position table the unit's input cast narrowed."""
    found: list[Finding] = []
    for (unit, name), (dtype, shape, to) in sorted(narrowed.items()):
        where = f"`{unit}`" if unit else "the root unit"
        found.append(
            Finding(
                code="CW172",
                message=(
                    f"FSDP2 unit {where} casts its forward input `{name}` ({dtype} {shape}), a position / phase "
                    f"table, to {to} (MixedPrecisionPolicy cast_forward_inputs with param_dtype={to}): {to} keeps "
                    f"{8 if to == 'bf16' else 11} significant bits, so positions past "
                    f"{256 if to == 'bf16' else 2048} and the rotary angles of long sequences are rounded."
                ),
                module=unit,
                origin=Origin(unit or None, None, f"input {name}"),
                modes=modes,
                fix=(
                    f"Pass `{name}` as an integer position tensor or a complex table (neither is cast), build it "
                    f"inside the unit from an f32 buffer, or shard {where} with MixedPrecisionPolicy("
                    "cast_forward_inputs=False) and cast the activations yourself."
                ),
            )
        )
    return found


def float8_tp_amax_findings(model: nn.Module, modes: tuple[Any, ...]) -> list[Finding]:
    """A CW173 warning per torchao Float8Linear whose Float8 TP style returns its output as a
    DTensor (``use_local_output=False``): torchao then takes the float8 amax of ``to_local()``,
    the TP-local shard, not of the tensor the TP group holds (torchtitan#3109)."""
    from castwise.distributed import tp

    f8 = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    found: list[Finding] = []
    for name, module in model.named_modules():
        if f8 is None or not isinstance(module, f8):
            continue
        for hook in module._forward_hooks.values():
            style = tp._style_fn(tp._closure(hook))
            if style is None or not style[0].startswith("Float8") or len(style[2]) < 2 or style[2][1] is not False:
                continue
            found.append(
                Finding(
                    code="CW173",
                    message=(
                        f"`{name}` (torchao Float8Linear) is tensor parallel with {style[0]}(use_local_output=False): "
                        "its output stays a DTensor, and torchao's float8 casts take the amax of its to_local(), "
                        "the TP-local shard, instead of reducing it over the TP group; each rank scales with its "
                        "own amax and training diverges (NaN loss within steps, torchtitan#3109)."
                    ),
                    module=name,
                    origin=Origin(name or None, None, None),
                    modes=modes,
                    fix=(
                        f"Use {style[0]}(use_local_output=True) (the default) for `{name}`, or plain "
                        "ColwiseParallel/RowwiseParallel (float8 GEMMs with high-precision TP collectives)."
                    ),
                )
            )
    return found
