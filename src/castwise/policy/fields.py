"""The fields of a Policy, declared once (torch-free at import).

Each field says its ``Policy`` attribute, its clause key in the grammar, how a clause value
parses and prints, its default (derived from params/compute), and how a Python value is
validated. ``Policy``'s parse, ``str``, validation and derived defaults all read this table;
``Policy``'s dataclass declares the same attributes, in the same order, for typing (checked at
import by ``castwise.policy.core``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from castwise import _dtypes
from castwise.errors import PolicyError
from castwise.policy.float8 import Float8Recipe

if TYPE_CHECKING:
    import torch

__all__ = [
    "BOOL_WORDS",
    "CLAUSE_KEYS",
    "DERIVED",
    "FIELDS",
    "Basis",
    "Field",
    "by_clause",
    "defaults",
    "parse_dtype",
]

Kind = Literal["dtype", "dtype?", "bool", "choice", "loss_scale", "float8"]

BOOL_WORDS: dict[str, bool] = {
    "on": True,
    "off": False,
    "true": True,
    "false": False,
    "yes": True,
    "no": False,
    "1": True,
    "0": False,
}


def parse_dtype(text: str, what: str) -> torch.dtype:
    """A clause's dtype value (``"bf16"``) as a torch dtype; ``what`` names the clause in errors."""
    name = _dtypes.canonical(text)
    if name is None or name not in _dtypes.POLICY_DTYPES:
        raise PolicyError(
            f"{what}: {text.strip()!r} is not a dtype castwise manages; valid: {_dtypes.POLICY_DTYPES_TEXT}"
        )
    return _dtypes.to_torch(name)


@dataclass(frozen=True)
class Basis:
    """What the derived defaults depend on: params, compute and (optionally) output."""

    params: torch.dtype
    compute: torch.dtype
    output: torch.dtype | None = None

    @property
    def mixed(self) -> bool:
        return self.params != self.compute

    @property
    def true_low(self) -> bool:
        """A "true" low-precision policy: weights and compute both bf16 or f16."""
        return not self.mixed and _dtypes.is_low(self.compute)


def _f32() -> torch.dtype:
    return _dtypes.to_torch("float32")


@dataclass(frozen=True)
class Field:
    """One Policy field: attribute, clause key, value grammar, default and validation."""

    attr: str
    clause: str
    kind: Kind
    default: Callable[[Basis], Any]
    none_words: tuple[str, ...] = ()  # clause values that mean None ("none", "off")
    choices: tuple[str, ...] = ()  # for kind "choice"
    derived: bool = False  # re-derived when a preset's params/compute are overridden

    def parse(self, text: str) -> Any:
        """A clause value as the field's Python value; PolicyError naming the clause if invalid."""
        low = text.lower()
        if low in self.none_words:
            return None
        if self.kind in ("dtype", "dtype?"):
            return parse_dtype(text, self.clause)
        if self.kind == "bool":
            if low not in BOOL_WORDS:
                raise PolicyError(f"{self.clause}={text!r} is not valid; valid: off, on")
            return BOOL_WORDS[low]
        if self.kind == "choice":
            if low not in self.choices:
                raise PolicyError(f"{self.clause}={text!r} is not valid; valid: {', '.join(sorted(self.choices))}")
            return low
        if self.kind == "float8":
            return Float8Recipe.parse(text)
        if low == "dynamic":
            return "dynamic"
        try:
            return float(text)
        except ValueError:
            raise PolicyError(f"{self.clause}={text!r} is not valid; valid: dynamic, none, or a number > 0") from None

    def show(self, value: Any) -> str:
        """The clause value that parses back to ``value``."""
        if value is None:
            return "none"
        if self.kind in ("dtype", "dtype?"):
            return _dtypes.short_of(value)
        if self.kind == "bool":
            return "on" if value else "off"
        return str(value)

    def check(self, value: Any) -> Any:
        """Validate a Python value (``Policy(...)``); returns it normalised (128 -> 128.0)."""
        if self.kind == "dtype" and not _dtypes.is_policy_dtype(value):
            raise PolicyError(f"{self.attr}={value!r} is not valid; valid: {_dtypes.POLICY_DTYPES_TEXT}")
        if self.kind == "dtype?" and value is not None and not _dtypes.is_policy_dtype(value):
            raise PolicyError(f"{self.attr}={value!r} is not valid; valid: None or {_dtypes.POLICY_DTYPES_TEXT}")
        if self.kind == "float8" and value is not None and not isinstance(value, Float8Recipe):
            raise PolicyError(
                f"{self.attr}={value!r} is not valid; valid: None or a castwise.policy.float8.Float8Recipe "
                "(in a policy string: fp8=tensorwise, fp8=rowwise, fp8=delayed, fp8=mxfp8, ...)"
            )
        if self.kind == "choice" and value not in self.choices:
            raise PolicyError(f"{self.attr}={value!r} is not valid; valid: {', '.join(sorted(self.choices))}")
        if self.kind == "loss_scale" and value is not None:
            if isinstance(value, int) and not isinstance(value, bool):
                value = float(value)  # 128 means 128.0
            if isinstance(value, bool) or not (
                value == "dynamic" or (isinstance(value, float) and 0 < value < math.inf)
            ):
                raise PolicyError(f"{self.attr}={value!r} is not valid; valid: 'dynamic', None or a float > 0")
        return value


def _input_default(b: Basis) -> torch.dtype | None:
    full64 = not b.mixed and _dtypes.name_of(b.compute) == "float64"
    return b.compute if b.true_low or full64 else None


FIELDS: tuple[Field, ...] = (
    Field("param_dtype", "params", "dtype", lambda b: b.params, derived=True),
    Field("compute_dtype", "compute", "dtype", lambda b: b.compute, derived=True),
    Field(
        "output_dtype",
        "output",
        "dtype",
        lambda b: b.output if b.output is not None else (_f32() if b.mixed else b.compute),
        derived=True,
    ),
    Field("buffer_dtype", "buffers", "dtype?", lambda b: None, none_words=("none", "params")),
    # buffers outside the state dict (rotary inv_freq) keep their dtype, as from_pretrained(dtype=) leaves them
    Field("keep_nonpersistent", "keep_nonpersistent", "bool", lambda b: False),
    # every buffer keeps its dtype, as FSDP2 (which casts parameters only) and DeepSpeed leave them
    Field("keep_buffers", "keep_buffers", "bool", lambda b: False),
    Field("input_dtype", "inputs", "dtype?", _input_default, none_words=("none", "off"), derived=True),
    Field("loss_scale", "loss_scale", "loss_scale", lambda b: None, none_words=("none", "off", "no")),
    Field("master_weights", "master_weights", "bool", lambda b: False),
    Field(
        "norms",
        "norms",
        "dtype?",
        lambda b: _f32() if b.true_low else None,
        none_words=("none", "off", "follow"),
        derived=True,
    ),
    Field("keep_in_fp32", "keep_in_fp32", "bool", lambda b: True),
    # complex parameters and buffers cast to the (real) storage dtype, as nn.Module.to(dtype) does
    # (torch/nn/modules/module.py, Module.to's convert: `t.is_floating_point() or t.is_complex()`):
    # what Lightning's *-true plugins run (convert_module); castwise's own presets keep them complex
    Field("cast_complex", "cast_complex", "bool", lambda b: False),
    # the model's tensors are as a framework converted them already (Lightning's convert_module ran
    # at setup, before the step castwise run meets): apply casts no parameter or buffer, so one made
    # after the conversion stays as the step meets it
    Field("converted", "converted", "bool", lambda b: False),
    Field("cast_back", "cast_back", "choice", lambda b: "saturate", choices=("saturate", "plain")),
    Field("fastpath", "fastpath", "bool", lambda b: True),
    # gradients reduced across ranks (castwise.fsdp2, castwise.export): float32 by default, since a
    # sum over many ranks loses bits in bf16/f16
    Field("reduce_dtype", "reduce", "dtype", lambda b: _f32()),
    # torch's default dtype while the model runs (Lightning's *-true set it around each step):
    # tensors made there without a dtype (torch.zeros, torch.arange(0.0, ...)) come out in it
    Field("default_dtype", "default_dtype", "dtype?", lambda b: None, none_words=("none", "off")),
    # a float8 training recipe on top of the base precision (castwise.policy.float8): which scaling
    # and format the Linears' GEMMs use; None: no float8
    Field("float8", "fp8", "float8", lambda b: None, none_words=("none", "off", "no")),
)

# every clause key the grammar knows, sorted as error messages list them
CLAUSE_KEYS: tuple[str, ...] = tuple(sorted([f.clause for f in FIELDS] + ["keep[SELECTOR]", "out[SELECTOR]"]))
DERIVED: tuple[str, ...] = tuple(f.attr for f in FIELDS if f.derived)
_BY_CLAUSE: Mapping[str, Field] = {f.clause: f for f in FIELDS}


def by_clause(key: str) -> Field | None:
    return _BY_CLAUSE.get(key)


def defaults(basis: Basis) -> dict[str, Any]:
    """Every field's value when only params/compute (and output) are given; no rules."""
    return {**{f.attr: f.default(basis) for f in FIELDS}, "rules": ()}
