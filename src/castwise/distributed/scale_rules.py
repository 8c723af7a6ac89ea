"""The audit's scale-only findings: what goes wrong only once a plan is sharded over a mesh.

CW170: a Linear whose global dims suit the policy's float8 / MX GEMM while its TP-local shard
does not (the conversion filters see the module before ``parallelize_module``; each rank's
``torch._scaled_mm`` then meets the local dims).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from castwise.policy import Policy
from castwise.report import Finding, Origin

if TYPE_CHECKING:
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
