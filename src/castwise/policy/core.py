"""The ``Policy`` value: one immutable description of how a model stores, computes and returns.

Its fields, their clause grammar, printing, defaults and validation are declared once in
``castwise.policy.fields``; the preset table is ``castwise.policy.presets``. This module adds the
rules that tie fields together (valid params/compute pairs, loss scaling, master weights).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch

from castwise._dtypes import is_low, short_of
from castwise.errors import PolicyError
from castwise.policy import fields as policy_fields
from castwise.policy import grammar, presets
from castwise.policy.fields import Basis
from castwise.policy.float8 import Float8Recipe
from castwise.policy.selectors import ModuleRule

__all__ = ["LossScale", "Policy"]

LossScale = float | Literal["dynamic"] | None

F32 = torch.float32


@dataclass(frozen=True)
class Policy:
    """How a model stores (``param_dtype``), computes (``compute_dtype``) and returns
    (``output_dtype``), plus the settings around it. See ``castwise.policy`` for the grammar.

    ``Policy.parse(text)`` reads every precision string users know; ``str(policy)`` prints a
    string that parses back to an equal policy.
    """

    # the attributes of castwise.policy.fields.FIELDS, in its order (checked below), plus rules
    param_dtype: torch.dtype = F32
    compute_dtype: torch.dtype = F32
    output_dtype: torch.dtype = F32
    buffer_dtype: torch.dtype | None = None  # None: as param_dtype
    keep_nonpersistent: bool = False  # non-persistent buffers left in the dtype the model built them in
    keep_buffers: bool = False  # every buffer left in the dtype the model built it in (FSDP2, DeepSpeed)
    input_dtype: torch.dtype | None = None  # None: inputs are not cast
    loss_scale: LossScale = None
    master_weights: bool = False
    norms: torch.dtype | None = None  # None: normalisation layers follow the policy
    keep_in_fp32: bool = True
    cast_complex: bool = False  # complex tensors cast with the real ones, as module.to(dtype) does
    converted: bool = False  # a framework converted the model's tensors already: apply casts none
    cast_back: Literal["saturate", "plain"] = "saturate"
    fastpath: bool = True
    reduce_dtype: torch.dtype = F32  # gradient reduction across ranks (castwise.fsdp2, castwise.export)
    default_dtype: torch.dtype | None = None  # None: torch's default dtype is left as it is
    float8: Float8Recipe | None = None  # float8 GEMMs on top of this precision (fp8=...); None: none
    rules: tuple[ModuleRule, ...] = ()

    def __post_init__(self) -> None:
        for f in policy_fields.FIELDS:
            value = getattr(self, f.attr)
            checked = f.check(value)
            if checked is not value:
                object.__setattr__(self, f.attr, checked)
        if not isinstance(self.rules, tuple) or not all(isinstance(r, ModuleRule) for r in self.rules):
            raise PolicyError("rules must be a tuple of castwise.ModuleRule")
        self._check_together()

    def _check_together(self) -> None:
        """The rules that tie fields together: each names both settings and the fix."""
        p, c = self.param_dtype, self.compute_dtype
        if p != c and (not is_low(c) or p != F32):
            raise PolicyError(
                f"params={short_of(p)} with compute={short_of(c)}: mixed precision keeps float32 weights "
                "and computes in bf16 or f16 under autocast; valid pairs: params equal to compute, "
                "or params=f32 with compute=bf16|f16"
            )
        if self.loss_scale is not None and is_low(p) and not self.master_weights:
            # GradScaler.unscale_ refuses half gradients ("Attempting to unscale FP16 gradients")
            raise PolicyError(
                f"loss_scale={self.loss_scale} with params={short_of(p)}: gradients would be stored in "
                f"{short_of(p)} and loss scaling cannot unscale them (GradScaler raises 'Attempting to "
                "unscale FP16 gradients'); use float32 params (a *-mixed policy), or master_weights=on"
            )
        if self.master_weights and not is_low(p):
            raise PolicyError(
                f"master_weights=on with params={short_of(p)}: master weights are float32 copies of "
                "bf16/f16 parameters; with float32 params there is nothing to copy; drop master_weights"
            )

    # -- derived ---------------------------------------------------------------------------

    @property
    def is_mixed(self) -> bool:
        """Mixed precision: float32 weights, low-precision compute under autocast."""
        return self.param_dtype != self.compute_dtype

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.compute_dtype if self.is_mixed else None

    def keeps_buffer(self, module: Any, name: str) -> bool:
        """Whether buffer ``name`` of ``module`` stays in the dtype the model built it in (every
        buffer under ``keep_buffers``, those outside the state dict under ``keep_nonpersistent``)."""
        return self.keep_buffers or (self.keep_nonpersistent and name in module._non_persistent_buffers_set)

    @property
    def effective_buffer_dtype(self) -> torch.dtype:
        return self.buffer_dtype if self.buffer_dtype is not None else self.param_dtype

    @classmethod
    def _defaults(cls, params: torch.dtype, compute: torch.dtype, output: torch.dtype | None = None) -> dict[str, Any]:
        """Field values a policy gets when only params/compute (and output) are given."""
        return policy_fields.defaults(Basis(params, compute, output))

    def _values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- text form -------------------------------------------------------------------------

    @classmethod
    def presets(cls) -> dict[str, Policy]:
        """Every preset name ``parse`` knows, with the policy it stands for."""
        return dict(_presets())

    @classmethod
    def parse(cls, text: str | int | Policy) -> Policy:
        """Read a precision string (see ``castwise.policy`` for every form); an int is Lightning's
        ``precision=16`` (``32``, ``64``)."""
        if isinstance(text, Policy):
            return text
        if isinstance(text, int) and not isinstance(text, bool):
            text = str(text)  # Lightning's precision=16 / 32 / 64
        if not isinstance(text, str):
            raise PolicyError(f"a policy is a string or a castwise.Policy, not {type(text).__name__}")
        parsed = grammar.read(text)
        given = dict(parsed.given)
        dtype = {k: policy_fields.parse_dtype(given.pop(k), k) for k in ("params", "compute", "output") if k in given}
        if parsed.preset is None:
            params = dtype.get("params", F32)
            base = cls._defaults(params, dtype.get("compute", params), dtype.get("output"))
        else:
            base = _presets()[parsed.preset]._values()
            if {"params", "compute"} & dtype.keys():
                # a preset with overridden params/compute re-derives the dependent defaults
                basis = Basis(
                    dtype.get("params", base["param_dtype"]),
                    dtype.get("compute", base["compute_dtype"]),
                    dtype.get("output"),
                )
                derived = policy_fields.defaults(basis)
                base.update({attr: derived[attr] for attr in policy_fields.DERIVED})
            elif "output" in dtype:
                base["output_dtype"] = dtype["output"]
        values = dict(base)
        for key, value in given.items():
            field = policy_fields.by_clause(key)
            if field is None:  # pragma: no cover  (grammar.read refuses unknown clauses)
                raise PolicyError(f"unknown clause {key!r}; valid clauses: {', '.join(policy_fields.CLAUSE_KEYS)}")
            values[field.attr] = field.parse(value)
        values["rules"] = tuple(values.get("rules", ())) + parsed.rules
        return cls(**values)

    def __str__(self) -> str:
        table = _presets()
        for name in presets.PREFERRED:
            if table[name] == self:
                return name
        values = self._values()
        # the preset with the same params/compute, plus the clauses that differ from it
        bases: list[tuple[str, list[str]]] = []
        for name in presets.PREFERRED:
            preset = table[name]
            if (preset.param_dtype, preset.compute_dtype) == (self.param_dtype, self.compute_dtype):
                clauses = grammar.clauses_against(values, preset._values())
                if clauses is not None:
                    bases.append((name, clauses))
                    if self.default_dtype is None and self.float8 is None:
                        break  # the first preset that fits (printing as it always did)
        if self.default_dtype is not None:
            # Lightning's *-true set the default dtype: a policy built on one prints as Lightning
            # says it ("lightning:bf16-true,keep[*.wo]=f32"), where no preset takes fewer clauses
            for name, preset in _lightning_presets().items():
                clauses = grammar.clauses_against(values, preset._values())
                same = (preset.param_dtype, preset.compute_dtype) == (self.param_dtype, self.compute_dtype)
                if preset == self or (same and clauses is not None):
                    bases.append((name, clauses or []))
        if bases:
            name, clauses = min(bases, key=lambda b: len(b[1]))
            return ",".join([name, *clauses])
        head = [f"params={short_of(self.param_dtype)}", f"compute={short_of(self.compute_dtype)}"]
        clauses = grammar.clauses_against(values, self._defaults(self.param_dtype, self.compute_dtype))
        return ",".join(head + (clauses or []))

    def with_rules(self, *rules: ModuleRule) -> Policy:
        """A copy with more module rules appended."""
        return replace(self, rules=self.rules + tuple(rules))

    def replace(self, **changes: Any) -> Policy:
        """A copy with fields changed (validated like a new policy)."""
        return replace(self, **changes)

    def describe(self) -> str:
        """One line in words: what this policy does."""
        if self.is_mixed:
            what = f"{short_of(self.param_dtype)} weights, autocast to {short_of(self.compute_dtype)}"
        else:
            what = f"{short_of(self.param_dtype)} weights and compute"
        extras = []
        if self.norms:
            extras.append(f"norms as {short_of(self.norms)} islands")
        if self.input_dtype:
            extras.append(f"inputs cast to {short_of(self.input_dtype)}")
        if self.loss_scale:
            extras.append(f"{self.loss_scale} loss scaling")
        if self.default_dtype is not None:
            extras.append(f"default dtype {short_of(self.default_dtype)} while the model runs")
        if not self.fastpath:
            extras.append("fused fast paths off")
        if self.float8 is not None:
            extras.append(self.float8.describe())
        extras += [str(r) for r in self.rules]
        return "; ".join([what, f"outputs {short_of(self.output_dtype)}", *extras])


_declared = tuple(f.name for f in fields(Policy))
if _declared != (*(f.attr for f in policy_fields.FIELDS), "rules"):  # a castwise bug: fail at import
    raise RuntimeError(f"Policy's attributes {_declared} do not follow castwise.policy.fields.FIELDS")

_PRESET_CACHE: dict[str, Policy] = {}
_LIGHTNING_CACHE: dict[str, Policy] = {}


def _lightning_presets() -> dict[str, Policy]:
    """Lightning's strings whose policy no castwise preset is (for printing; ``presets()`` lists
    castwise's own names)."""
    if not _LIGHTNING_CACHE:
        _LIGHTNING_CACHE.update({f"lightning:{n}": Policy.parse(f"lightning:{n}") for n in presets.LIGHTNING_CLAUSES})
    return _LIGHTNING_CACHE


def _presets() -> dict[str, Policy]:
    """Every preset as a Policy, built once from its clause string (presets that mean the same
    policy share one object)."""
    if not _PRESET_CACHE:
        built: dict[str, Policy] = {}
        for name, preset in presets.PRESETS.items():
            if preset.text not in built:
                built[preset.text] = Policy.parse(preset.text)
            _PRESET_CACHE[name] = built[preset.text]
    return _PRESET_CACHE
