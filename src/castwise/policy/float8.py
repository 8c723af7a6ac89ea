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
- scaling, 4-bit: ``nvfp4`` (E2M1 values in 16-element blocks, an E4M3 scale per block and an
  f32 scale per tensor: TransformerEngine's ``NVFP4BlockScaling``, torchao's NVFP4 training,
  Megatron's ``--fp4-recipe nvfp4``), ``mxfp4`` (E2M1 in blocks of 32 with E8M0 scales: the OCP
  MX format, trained through QAT);
- format: ``e4m3`` (float8_e4m3fn everywhere), ``e5m2``, or ``hybrid`` (e4m3 forward, e5m2 for
  gradients: TransformerEngine's ``Format.HYBRID``); ``e2m1`` for the 4-bit scalings (their only
  one). The default is ``hybrid`` for ``delayed`` (TransformerEngine's default), ``e2m1`` for the
  4-bit ones and ``e4m3`` for the others.

``current`` (TransformerEngine's ``Float8CurrentScaling``: per tensor from the current amax) reads
as ``tensorwise``, and ``subchannel`` (Megatron-Bridge's 1x128 / 128x128 blocks) as ``blockwise``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast

from castwise.errors import PolicyError
from castwise.policy import toolnames

__all__ = ["FORMATS", "NAMED", "SCALINGS", "Float8Recipe", "named"]

Scaling = Literal["tensorwise", "rowwise", "delayed", "blockwise", "mxfp8", "nvfp4", "mxfp4"]
Format = Literal["e4m3", "e5m2", "hybrid", "e2m1"]
SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise", "delayed", "blockwise", "mxfp8", "nvfp4", "mxfp4")
FP4: tuple[str, ...] = ("nvfp4", "mxfp4")  # the 4-bit scalings: E2M1 values
FORMATS: tuple[str, ...] = ("e4m3", "e5m2", "hybrid", "e2m1")
# other tools' words for a scaling castwise has
SCALING_ALIASES: dict[str, str] = {"current": "tensorwise", "subchannel": "blockwise"}
MX_BLOCK = 32  # the OCP MX block: elements per shared E8M0 scale
NVFP4_BLOCK = 16  # NVFP4: elements per E4M3 block scale
# the elements one scale covers along a GEMM's reduction dim (absent: the whole tensor or row)
BLOCK: dict[str, int] = {"blockwise": 128, "mxfp8": MX_BLOCK, "nvfp4": NVFP4_BLOCK, "mxfp4": MX_BLOCK}
# other tools' names for a GEMM recipe (castwise.policy.toolnames): written TOOL:NAME
NAMED = toolnames.TOOLS


def named(text: str) -> str | None:
    """castwise's fp8= value for a tool's recipe name (``te:NVFP4BlockScaling``,
    ``torchao:rowwise``); None when ``text`` is not one. PolicyError for an unknown name of a tool."""
    return toolnames.named(text)


_DTYPE: dict[str, str] = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e2m1": "float4_e2m1fn_x2"}


def default_format(scaling: str) -> Format:
    return "hybrid" if scaling == "delayed" else "e2m1" if scaling in FP4 else "e4m3"


@dataclass(frozen=True)
class Float8Recipe:
    """Which scaling and float8 format a policy's float8 GEMMs use; ``str()`` is its clause value."""

    scaling: Scaling = "tensorwise"
    format: Format | None = None  # None: the scaling's default
    # how the tool's recipe this was read from differs from castwise's emulation ('' : it does not);
    # not part of the value: the recipe prints and compares as its scaling and format
    note: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise PolicyError(f"fp8 scaling {self.scaling!r} is not valid; valid: {', '.join(SCALINGS)}")
        if self.format is None:
            object.__setattr__(self, "format", default_format(self.scaling))
        elif self.format not in FORMATS:
            raise PolicyError(f"fp8 format {self.format!r} is not valid; valid: {', '.join(FORMATS)}")
        elif (self.format == "e2m1") != (self.scaling in FP4):
            valid = "e2m1" if self.scaling in FP4 else ", ".join(f for f in FORMATS if f != "e2m1")
            raise PolicyError(f"fp8={self.scaling}:{self.format} is not valid; {self.scaling} takes {valid}")

    @classmethod
    def parse(cls, text: str) -> Float8Recipe:
        """``"tensorwise"``, ``"delayed:e4m3"``...; PolicyError naming the valid values."""
        scaling, _, fmt = (named(text) or text).strip().lower().partition(":")
        scaling = SCALING_ALIASES.get(scaling, scaling)
        if scaling not in SCALINGS:
            raise PolicyError(
                f"fp8={text.strip()!r} is not valid; valid: none, or SCALING[:FORMAT] with SCALING one of "
                f"{', '.join(SCALINGS)} and FORMAT one of {', '.join(FORMATS)}; or a tool's recipe name: "
                f"{', '.join(f'{tool}:NAME' for tool in NAMED)}"
            )
        return cls(cast(Scaling, scaling), cast(Format, fmt) if fmt else None, toolnames.note(text))

    def __str__(self) -> str:
        return self.scaling if self.format == default_format(self.scaling) else f"{self.scaling}:{self.format}"

    @property
    def forward_dtype(self) -> str:
        """The canonical float8 dtype name the forward GEMMs' inputs and weights are cast to."""
        return _DTYPE.get(str(self.format), "float8_e4m3fn")

    @property
    def gradient_dtype(self) -> str:
        """The float8 dtype the backward GEMMs take gradients in (E2M1 for NVFP4, which quantizes
        gradients too; MXFP4's QAT passes them through in the base dtype, named as its format)."""
        if self.format == "e2m1":
            return _DTYPE["e2m1"]
        return "float8_e4m3fn" if self.format == "e4m3" else "float8_e5m2"

    @property
    def fp4(self) -> bool:
        """Whether the GEMMs take 4-bit (E2M1) values: nvfp4, mxfp4."""
        return self.scaling in FP4

    @property
    def block(self) -> int | None:
        """Elements per scale along the reduction dim (None: per tensor, or per row)."""
        return BLOCK.get(self.scaling)

    def describe(self) -> str:
        return self._describe() + (f" ({self.note})" if self.note else "")

    def _describe(self) -> str:
        if self.scaling == "nvfp4":
            return "NVFP4 GEMMs in Linears (e2m1 in blocks of 16, e4m3 block scales, an f32 tensor scale)"
        if self.scaling == "mxfp4":
            return "MXFP4 GEMMs in Linears (e2m1 in blocks of 32, e8m0 block scales)"
        fmt = {"e4m3": "e4m3", "e5m2": "e5m2", "hybrid": "e4m3 forward, e5m2 gradients"}[str(self.format)]
        return f"float8 GEMMs in Linears ({self.scaling} scaling, {fmt})"
