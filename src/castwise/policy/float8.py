"""FP8 as a recipe on top of a base precision (torch-free: lint-config reads it too).

A float8 training recipe does not change what a model stores or where autocast runs: it swaps
the GEMMs of its Linears for float8 matmuls (inputs and weights scaled into a float8 format,
accumulated in float32, output in the base compute dtype). So a ``Policy`` keeps its base
precision (``bf16-mixed`` for Accelerate's ``fp8``, Lightning's ``bf16-true`` for
``transformer-engine``) and adds one ``Float8Recipe`` value, written ``fp8=SCALING[:FORMAT]``:

- scaling: ``tensorwise`` (one scale per tensor from its current amax: torchao's default
  ``Float8LinearConfig``, Accelerate's AO backend), ``rowwise`` (one per row, torchao's
  ``rowwise`` recipe), ``delayed`` (per tensor, from an amax history: TransformerEngine's
  ``DelayedScaling``, Lightning's and Megatron's default), ``blockwise`` (1x128 / 128x128
  blocks: Megatron's ``--fp8-recipe blockwise``), ``mxfp8`` (blocks of 32 with power-of-two
  scales: the OCP MX format, torchao's and TransformerEngine's MXFP8);
- format: ``e4m3`` (float8_e4m3fn everywhere), ``e5m2``, or ``hybrid`` (e4m3 forward, e5m2 for
  gradients: TransformerEngine's ``Format.HYBRID``). The default is ``hybrid`` for ``delayed``
  (TransformerEngine's default) and ``e4m3`` for the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

from castwise.errors import PolicyError

__all__ = ["FORMATS", "SCALINGS", "Float8Recipe"]

Scaling = Literal["tensorwise", "rowwise", "delayed", "blockwise", "mxfp8"]
Format = Literal["e4m3", "e5m2", "hybrid"]
SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise", "delayed", "blockwise", "mxfp8")
FORMATS: tuple[str, ...] = ("e4m3", "e5m2", "hybrid")
MX_BLOCK = 32  # the OCP MX block: elements per shared E8M0 scale
# the elements one scale covers along a GEMM's reduction dim (absent: the whole tensor or row)
BLOCK: dict[str, int] = {"blockwise": 128, "mxfp8": MX_BLOCK}
_DTYPE: dict[str, str] = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def default_format(scaling: str) -> Format:
    return "hybrid" if scaling == "delayed" else "e4m3"


@dataclass(frozen=True)
class Float8Recipe:
    """Which scaling and float8 format a policy's float8 GEMMs use; ``str()`` is its clause value."""

    scaling: Scaling = "tensorwise"
    format: Format | None = None  # None: the scaling's default

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise PolicyError(f"fp8 scaling {self.scaling!r} is not valid; valid: {', '.join(SCALINGS)}")
        if self.format is None:
            object.__setattr__(self, "format", default_format(self.scaling))
        elif self.format not in FORMATS:
            raise PolicyError(f"fp8 format {self.format!r} is not valid; valid: {', '.join(FORMATS)}")

    @classmethod
    def parse(cls, text: str) -> Float8Recipe:
        """``"tensorwise"``, ``"delayed:e4m3"``...; PolicyError naming the valid values."""
        scaling, _, fmt = text.strip().lower().partition(":")
        if scaling not in SCALINGS:
            raise PolicyError(
                f"fp8={text.strip()!r} is not valid; valid: none, or SCALING[:FORMAT] with SCALING one of "
                f"{', '.join(SCALINGS)} and FORMAT one of {', '.join(FORMATS)}"
            )
        return cls(cast(Scaling, scaling), cast(Format, fmt) if fmt else None)

    def __str__(self) -> str:
        return self.scaling if self.format == default_format(self.scaling) else f"{self.scaling}:{self.format}"

    @property
    def forward_dtype(self) -> str:
        """The canonical float8 dtype name the forward GEMMs' inputs and weights are cast to."""
        return _DTYPE.get(str(self.format), "float8_e4m3fn")

    @property
    def gradient_dtype(self) -> str:
        """The float8 dtype the backward GEMMs take gradients in."""
        return "float8_e4m3fn" if self.format == "e4m3" else "float8_e5m2"

    @property
    def block(self) -> int | None:
        """Elements per scale along the reduction dim (None: per tensor, or per row)."""
        return BLOCK.get(self.scaling)

    def describe(self) -> str:
        fmt = {"e4m3": "e4m3", "e5m2": "e5m2", "hybrid": "e4m3 forward, e5m2 gradients"}[str(self.format)]
        return f"float8 GEMMs in Linears ({self.scaling} scaling, {fmt})"
