"""Dtype names without importing torch: parsing user spellings, printing the way torch does.

castwise prints dtypes in torch's short form (``bf16``, ``f16``, ``f32``) and tensors as
``bf16[2, 4]``. Everything here works on canonical *names* (``"bfloat16"``), so the CLI paths
that must not import torch (explain, lint-config) can use it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# canonical name -> short name torch prints (torch's own `dtype.__repr__` minus "torch.")
SHORT: dict[str, str] = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "b8",
    "complex64": "c64",
    "complex128": "c128",
}

# canonical name -> c10::ScalarType name, as kernel errors print dtypes ("expected scalar type
# Float but found BFloat16", "\"cdist\" not implemented for 'Half'")
SCALAR_TYPE: dict[str, str] = {
    "float32": "Float",
    "float64": "Double",
    "bfloat16": "BFloat16",
    "float16": "Half",
    "int64": "Long",
    "int32": "Int",
    "int16": "Short",
    "int8": "Char",
    "uint8": "Byte",
    "bool": "Bool",
    "complex32": "ComplexHalf",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
}

# every spelling users write for the floating dtypes a policy can name
ALIASES: dict[str, str] = {
    "float64": "float64",
    "f64": "float64",
    "fp64": "float64",
    "double": "float64",
    "64": "float64",
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "32": "float32",
    "full": "float32",
    "float16": "float16",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

POLICY_DTYPES = ("bfloat16", "float16", "float32", "float64")
LOW = ("bfloat16", "float16")  # "low precision": the 16-bit floating dtypes mixed precision runs in
# the floating dtypes castwise manages, as an error message lists them
POLICY_DTYPES_TEXT = (
    ", ".join(sorted(SHORT[n] for n in POLICY_DTYPES)) + " (or " + ", ".join(sorted(POLICY_DTYPES)) + ")"
)
# storage bits of the policy dtypes: a cast to a wider one is lossless (f16 -> bf16 is not: same width)
BITS: dict[str, int] = {"float64": 64, "float32": 32, "float16": 16, "bfloat16": 16}


def canonical(text: str) -> str | None:
    """The canonical name for a user's spelling (``"bf16"`` -> ``"bfloat16"``), or None."""
    key = text.strip().lower()
    if key.startswith("torch."):
        key = key[len("torch.") :]
    return ALIASES.get(key)


def from_scalar_type(word: str) -> str | None:
    """A c10::ScalarType name (``"BFloat16"``) or canonical name as an error prints it, to the
    canonical name (``"bfloat16"``); None when it is neither."""
    if word in SCALAR_TYPE:
        return word
    return next((name for name, scalar in SCALAR_TYPE.items() if scalar == word), None)


def short(name: str) -> str:
    """``"bfloat16"`` -> ``"bf16"``; unknown names print as they are."""
    return SHORT.get(name, name)


def name_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def short_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``."""
    return short(name_of(dtype))


def is_policy_dtype(value: object) -> bool:
    """Whether ``value`` is a torch dtype a policy can name (f64, f32, f16, bf16). Never imports
    torch: a torch dtype cannot exist unless torch is already imported."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype) and name_of(value) in POLICY_DTYPES


def widens(src: str, dst: str) -> bool:
    """Whether casting ``src`` to ``dst`` (canonical names) keeps every value exactly."""
    return src in BITS and dst in BITS and BITS[dst] > BITS[src]


def to_torch(name: str) -> torch.dtype:
    """A canonical name to the torch dtype (imports torch)."""
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


def fmt_tensor(dtype_name: str, shape: Iterable[int]) -> str:
    """``fmt_tensor("bfloat16", (2, 4))`` -> ``"bf16[2, 4]"``."""
    return f"{short(dtype_name)}[{', '.join(str(int(s)) for s in shape)}]"


def is_low(dtype: str | torch.dtype) -> bool:
    """True for the 16-bit floating dtypes mixed precision runs in (a canonical name or a torch dtype)."""
    return (dtype if isinstance(dtype, str) else name_of(dtype)) in LOW


def low_dtypes() -> tuple[torch.dtype, ...]:
    """``LOW`` as torch dtypes (imports torch), for membership tests on a hot path."""
    return tuple(to_torch(n) for n in LOW)
