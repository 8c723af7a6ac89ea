"""Precision policies: one immutable value for how a model stores, computes and returns.

Grammar
=======
A policy string is a comma-separated list of clauses. The first clause may be a preset name;
later clauses override what the preset says. Whitespace around clauses is ignored and dtype
names may be long or short (``float32``/``f32``/``fp32``, ``bfloat16``/``bf16``,
``float16``/``f16``/``fp16``/``half``, ``float64``/``f64``).

Presets (what each ecosystem's string means, read from its code):

=========================  ======================================================================
``32-true`` ``no`` ``fp32`` ``O0``   float32 everywhere (Lightning, Accelerate, OpenCLIP, Apex).
``64-true``                float64 everywhere, inputs cast to float64 (Lightning).
``16-mixed`` ``fp16`` (Accelerate) ``amp`` ``O1``
                           float32 weights, float16 autocast, dynamic loss scaling (GradScaler),
                           outputs float32. Accelerate's ``fp16`` and OpenCLIP's ``amp`` are this;
                           Apex O1 patches functions instead of autocast, to the same effect.
``bf16-mixed`` ``bf16`` (Accelerate) ``amp_bf16`` ``amp_bfloat16``
                           float32 weights, bfloat16 autocast, no loss scaling, outputs float32.
``16-true``                float16 weights, compute and inputs; normalisation layers stay
                           float32 islands; output float16. (Lightning's ``16-true`` converts the
                           module and the inputs; castwise adds the norm islands users expect,
                           like OpenCLIP's ``fp16`` with its LayerNormFp32.)
``bf16-true``              the same in bfloat16 (OpenCLIP's ``bf16`` = this).
``pure_fp16``              float16 everything, norms included, no loss scaling (OpenCLIP
                           ``pure_fp16``: ``model.to(float16)``, inputs cast to float16).
``O3``                     Apex O3: the same, but Apex casts the model's outputs to float32.
``pure_bf16``              bfloat16 everything, norms included (OpenCLIP ``pure_bf16``).
``O2``                     Apex O2: float16 weights and inputs, BatchNorm kept float32, float32
                           master weights in the optimizer, dynamic loss scaling, outputs float32.
=========================  ======================================================================

``fp16`` and ``bf16`` alone are read as Accelerate's ``--mixed_precision`` values (autocast),
their most common home. OpenCLIP's ``--precision fp16|bf16`` (weights stored in half, norms
float32) is castwise's ``16-true``/``bf16-true``; to say which ecosystem a string comes from,
prefix it: ``openclip:bf16``, ``accelerate:bf16``, ``lightning:bf16-mixed``, ``apex:O2``.
With the ``lightning:`` prefix, ``16-true``/``bf16-true`` mean what Lightning does (the whole
module converted, norms included: castwise's ``pure_fp16``/``pure_bf16``).

Mixed policies (``compute`` narrower than ``params``) leave the model's tensors as they are
and let autocast cast at each op, as Lightning's and Accelerate's mixed precision do: only
islands (``keep[...]``, norms, ``_keep_in_fp32_modules``) and an explicit ``buffers=`` clause
cast tensors. ``params=f32`` there says what autocast expects, and ``castwise.audit`` reports
tensors that are not in it. True policies store every tensor in the policy's dtypes.

jmp-style and castwise clauses (every one optional; defaults derive from params/compute):

- ``params=DT`` storage dtype of parameters (default float32)
- ``compute=DT`` dtype ops run in (default: params). ``compute`` narrower than ``params`` means
  mixed precision: weights stay in ``params`` and ops run under autocast in ``compute``.
- ``output=DT`` dtype of the model's floating outputs (default: float32 when mixed, else compute)
- ``buffers=DT`` floating buffers (default: params)
- ``inputs=DT|none`` cast the model's floating inputs (default: compute for low-precision "true"
  policies, none otherwise)
- ``loss_scale=dynamic|none|FLOAT`` (default none)
- ``master_weights=on|off`` float32 master copies in the optimizer (default off)
- ``norms=DT|none`` normalisation layers as islands in DT (default float32 for low-precision
  "true" policies, none otherwise)
- ``keep_in_fp32=on|off`` honour a model's ``_keep_in_fp32_modules`` (default on), as
  transformers does: under float16 compute, plus ``_keep_in_fp32_modules_strict`` under float16
  and bfloat16 compute
- ``cast_back=saturate|plain`` how an island's output returns to float16: clamped to float16's
  finite range first (default), or plainly cast
- ``reduce=DT`` dtype gradients are reduced in across ranks (FSDP2's ``reduce_dtype``, DeepSpeed's
  ``communication_data_type``; default float32: a sum over many ranks loses bits in bf16/f16)
- ``fastpath=on|off`` allow fused TransformerEncoderLayer/MultiheadAttention fast paths while the
  model runs (default on, torch's default)
- ``keep[SELECTOR]=DT`` run matching modules as islands in DT: parameters and buffers stored in
  DT, floating inputs cast to DT, autocast off inside, outputs cast back to the compute dtype
- ``out[SELECTOR]=DT`` cast matching modules' floating outputs to DT

SELECTOR: a glob on dotted name segments (``*.wo``: ``*`` is one segment, ``**`` any number),
``re:REGEX`` (full match on the qualified name), or ``class:NAME`` (the module's class or a base
class, by name or dotted path, e.g. ``class:LayerNorm`` or ``class:torch.nn.LayerNorm``).
In Python a rule may also select by a class object or a predicate ``(name, module) -> bool``;
predicate rules print as ``fn:qualname`` and cannot be parsed back.

Rule precedence: a user's ``keep``/``out`` rules, then the model's ``_keep_in_fp32_modules``,
then the ``norms`` default. Two user rules of one kind that match the same module with
different dtypes are an error naming both. A rule on a module inside an island applies to
that inner module.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from castwise import _dtypes
from castwise.errors import PolicyError, RuleError

if TYPE_CHECKING:
    from torch import nn

Predicate = Callable[[str, "nn.Module"], bool]
Selector = str | type | Predicate  # a class is stored as its "class:module.QualName" string
RuleKind = Literal["keep", "out"]
LossScale = float | Literal["dynamic"] | None

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
_WIDTH = {F64: 64, F32: 32, F16: 16, BF16: 16}
_SHORT_DTYPE_NAMES = "bf16, f16, f32, f64 (or bfloat16, float16, float32, float64)"


def _dtype(text: str, what: str) -> torch.dtype:
    name = _dtypes.canonical(text)
    if name is None or name not in _dtypes.POLICY_DTYPES:
        raise PolicyError(f"{what}: {text.strip()!r} is not a dtype castwise manages; valid: {_SHORT_DTYPE_NAMES}")
    return _dtypes.to_torch(name)


def _short(dtype: torch.dtype) -> str:
    return _dtypes.short_of(dtype)


# ---------------------------------------------------------------------------------------------
# module rules


def _class_names(cls: type) -> set[str]:
    return {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}


def _segment_regex(segment: str) -> str:
    """One dotted segment of a glob, as fnmatch reads it but never crossing a dot: ``*`` any
    run, ``?`` one character, ``[...]``/``[!...]`` a character class; the rest literal."""
    out, i, n = "", 0, len(segment)
    while i < n:
        ch = segment[i]
        if ch == "*":
            out += r"[^.]*"
        elif ch == "?":
            out += r"[^.]"
        elif ch == "[":
            j = i + 1
            j += segment[j : j + 1] == "!"
            j += segment[j : j + 1] == "]"  # a ']' first in the class is literal, as in fnmatch
            close = segment.find("]", j)
            if close < 0:
                out += re.escape(ch)
            else:
                body = segment[i + 1 : close]
                negate = body.startswith("!")
                body = "".join("\\" + c if c in "\\[]^" else c for c in (body[1:] if negate else body))
                out += "[" + ("^." if negate else "") + body + "]"
                i = close
        else:
            out += re.escape(ch)
        i += 1
    return out


def _glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Glob on dotted segments: ``*`` one segment, ``**`` zero or more segments."""
    parts: list[str | None] = [None if seg == "**" else _segment_regex(seg) for seg in pattern.split(".")]
    out = ""
    for i, part in enumerate(parts):
        if part is None:
            # zero or more whole segments, with the dots that join them
            out += r"(?:[^.]+(?:\.[^.]+)*)?" if i == len(parts) - 1 else r"(?:[^.]+\.)*"
            continue
        out += part
        if i < len(parts) - 1 and parts[i + 1] is not None:
            out += r"\."
        elif i < len(parts) - 1:
            out += r"(?:\.|$)" if i + 1 == len(parts) - 1 else r"\."
    return re.compile(out)


@dataclass(frozen=True)
class ModuleRule:
    """Pin modules to a dtype: ``kind="keep"`` makes them islands, ``"out"`` casts outputs.

    ``selector``: a glob on dotted names (``"*.wo"``), ``"re:..."``, ``"class:Name"``, a module
    class (stored as ``"class:module.QualName"`` so the rule prints and parses back), or a
    predicate ``(name, module) -> bool``.
    """

    selector: Selector
    dtype: torch.dtype
    kind: RuleKind = "keep"
    _match: Callable[[str, Any], bool] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in ("keep", "out"):
            raise RuleError(f"rule kind {self.kind!r} is not valid; valid: keep, out")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in _WIDTH:
            raise RuleError(f"rule dtype {self.dtype!r} is not valid; valid: {_SHORT_DTYPE_NAMES}")
        selector = self.selector
        if isinstance(selector, type):
            selector = f"class:{selector.__module__}.{selector.__qualname__}"
            object.__setattr__(self, "selector", selector)
        if isinstance(selector, str):
            object.__setattr__(self, "_match", _compile_selector(selector))
        elif callable(selector):
            predicate = selector
            object.__setattr__(self, "_match", lambda name, module: bool(predicate(name, module)))
        else:
            raise RuleError(
                f"rule selector {selector!r} is not valid; valid: a glob like '*.wo', 're:REGEX', "
                "'class:Name', a module class, or a predicate (name, module) -> bool"
            )

    def matches(self, name: str, module: nn.Module) -> bool:
        return self._match(name, module)

    @property
    def selector_text(self) -> str:
        if isinstance(self.selector, str):
            return self.selector
        fn = self.selector
        return f"fn:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def __str__(self) -> str:
        return f"{self.kind}[{self.selector_text}]={_short(self.dtype)}"


def _compile_selector(selector: str) -> Callable[[str, Any], bool]:
    if not selector.strip():
        raise RuleError("empty rule selector; valid: a glob like '*.wo', 're:REGEX' or 'class:Name'")
    if selector.startswith("fn:"):
        raise RuleError(
            f"{selector!r}: predicate rules cannot be parsed from text; pass a callable "
            "ModuleRule(lambda name, module: ..., dtype) in Python"
        )
    if selector.startswith("re:"):
        try:
            regex = re.compile(selector[3:])
        except re.error as exc:
            raise RuleError(f"rule selector {selector!r}: bad regular expression ({exc})") from None
        return lambda name, module: regex.fullmatch(name) is not None
    if selector.startswith("class:"):
        wanted = selector[len("class:") :].strip()
        if not wanted:
            raise RuleError("rule selector 'class:' names no class; e.g. 'class:LayerNorm'")
        # torch re-exports classes under shorter paths (torch.nn.LayerNorm): match the tail too
        tail = wanted.rsplit(".", 1)[-1]

        def by_class(name: str, module: Any) -> bool:
            for cls in type(module).__mro__:
                names = _class_names(cls)
                if wanted in names or ("." in wanted and tail == cls.__name__ and _same_home(wanted, cls)):
                    return True
            return False

        return by_class
    regex = _glob_to_regex(selector)
    return lambda name, module: regex.fullmatch(name) is not None


def _same_home(dotted: str, cls: type) -> bool:
    """``torch.nn.LayerNorm`` names ``torch.nn.modules.normalization.LayerNorm``: same package."""
    package = dotted.rsplit(".", 1)[0]
    return cls.__module__ == package or cls.__module__.startswith(package + ".")


# ---------------------------------------------------------------------------------------------
# the policy


_BOOL = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}
_CLAUSES = (
    "buffers",
    "cast_back",
    "compute",
    "fastpath",
    "inputs",
    "keep[SELECTOR]",
    "keep_in_fp32",
    "loss_scale",
    "master_weights",
    "norms",
    "out[SELECTOR]",
    "output",
    "params",
    "reduce",
)


@dataclass(frozen=True)
class Policy:
    """How a model stores (``param_dtype``), computes (``compute_dtype``) and returns
    (``output_dtype``), plus the settings around it. See the module docstring for the grammar.

    ``Policy.parse(text)`` reads every precision string users know; ``str(policy)`` prints a
    string that parses back to an equal policy.
    """

    param_dtype: torch.dtype = F32
    compute_dtype: torch.dtype = F32
    output_dtype: torch.dtype = F32
    buffer_dtype: torch.dtype | None = None  # None: as param_dtype
    input_dtype: torch.dtype | None = None  # None: inputs are not cast
    loss_scale: LossScale = None
    master_weights: bool = False
    norms: torch.dtype | None = None  # None: normalisation layers follow the policy
    keep_in_fp32: bool = True
    cast_back: Literal["saturate", "plain"] = "saturate"
    fastpath: bool = True
    rules: tuple[ModuleRule, ...] = ()
    reduce_dtype: torch.dtype = F32  # gradient reduction across ranks (castwise.fsdp2, castwise.export)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype", "output_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if not isinstance(value, torch.dtype) or value not in _WIDTH:
                raise PolicyError(f"{name}={value!r} is not valid; valid: {_SHORT_DTYPE_NAMES}")
        for name in ("buffer_dtype", "input_dtype", "norms"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or value not in _WIDTH):
                raise PolicyError(f"{name}={value!r} is not valid; valid: None or {_SHORT_DTYPE_NAMES}")
        if not isinstance(self.rules, tuple) or not all(isinstance(r, ModuleRule) for r in self.rules):
            raise PolicyError("rules must be a tuple of castwise.ModuleRule")
        if self.cast_back not in ("saturate", "plain"):
            raise PolicyError(f"cast_back={self.cast_back!r} is not valid; valid: plain, saturate")
        p, c = self.param_dtype, self.compute_dtype
        if p != c and (c not in (F16, BF16) or p != F32):
            raise PolicyError(
                f"params={_short(p)} with compute={_short(c)}: mixed precision keeps float32 weights "
                "and computes in bf16 or f16 under autocast; valid pairs: params equal to compute, "
                "or params=f32 with compute=bf16|f16"
            )
        if isinstance(self.loss_scale, int) and not isinstance(self.loss_scale, bool):
            object.__setattr__(self, "loss_scale", float(self.loss_scale))  # 128 means 128.0
        if self.loss_scale is not None:
            if isinstance(self.loss_scale, bool) or not (
                self.loss_scale == "dynamic" or (isinstance(self.loss_scale, float) and 0 < self.loss_scale < math.inf)
            ):
                raise PolicyError(f"loss_scale={self.loss_scale!r} is not valid; valid: 'dynamic', None or a float > 0")
            if p in (F16, BF16) and not self.master_weights:
                # GradScaler.unscale_ refuses half gradients ("Attempting to unscale FP16 gradients")
                raise PolicyError(
                    f"loss_scale={self.loss_scale} with params={_short(p)}: gradients would be stored in "
                    f"{_short(p)} and loss scaling cannot unscale them (GradScaler raises 'Attempting to "
                    "unscale FP16 gradients'); use float32 params (a *-mixed policy), or master_weights=on"
                )
        if self.master_weights and p not in (F16, BF16):
            raise PolicyError(
                f"master_weights=on with params={_short(p)}: master weights are float32 copies of "
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

    @property
    def effective_buffer_dtype(self) -> torch.dtype:
        return self.buffer_dtype if self.buffer_dtype is not None else self.param_dtype

    @classmethod
    def _defaults(cls, params: torch.dtype, compute: torch.dtype, output: torch.dtype | None = None) -> dict[str, Any]:
        """Field values a policy gets when only params/compute (and output) are given."""
        mixed = params != compute
        true_low = not mixed and compute in (F16, BF16)
        return {
            "param_dtype": params,
            "compute_dtype": compute,
            "output_dtype": output if output is not None else (F32 if mixed else compute),
            "buffer_dtype": None,
            "input_dtype": compute if true_low or (not mixed and compute == F64) else None,
            "loss_scale": None,
            "master_weights": False,
            "norms": F32 if true_low else None,
            "keep_in_fp32": True,
            "cast_back": "saturate",
            "fastpath": True,
            "rules": (),
            "reduce_dtype": F32,
        }

    # -- text form -------------------------------------------------------------------------

    @classmethod
    def presets(cls) -> dict[str, Policy]:
        """Every preset name ``parse`` knows, with the policy it stands for."""
        return dict(_presets())

    @classmethod
    def parse(cls, text: str | Policy) -> Policy:
        """Read a precision string (see the module docstring for every form)."""
        if isinstance(text, Policy):
            return text
        if not isinstance(text, str):
            raise PolicyError(f"a policy is a string or a castwise.Policy, not {type(text).__name__}")
        clauses = _split(text)
        if not clauses:
            raise PolicyError(f"empty policy string; valid presets: {', '.join(sorted(_presets()))}")
        presets = _presets()
        base: dict[str, Any] | None = None
        first = clauses[0].strip()
        if "=" not in first:
            preset = _lookup_preset(first)
            base = {f.name: getattr(preset, f.name) for f in fields(cls)}
            clauses = clauses[1:]
        given: dict[str, str] = {}
        rules: list[ModuleRule] = []
        for clause in clauses:
            clause = clause.strip()
            if "=" not in clause:
                hint = " (a preset may only come first)" if clause in presets else ""
                raise PolicyError(f"clause {clause!r} has no '='{hint}; valid clauses: {', '.join(_CLAUSES)}")
            m = _RULE_CLAUSE.fullmatch(clause)
            if m:
                kind, selector, value = m.group(1), m.group(2), m.group(3).strip()
                rules.append(ModuleRule(selector, _dtype(value, f"{kind}[{selector}]"), kind))  # type: ignore[arg-type]
                continue
            key, _, value = clause.partition("=")
            key, value = key.strip(), value.strip()
            key = key.lower()
            if key not in {c for c in _CLAUSES if "[" not in c}:
                raise PolicyError(
                    f"unknown clause {key!r}{_did_you_mean(key, _CLAUSES)}; valid clauses: {', '.join(_CLAUSES)}"
                )
            if key in given:
                raise PolicyError(f"clause {key!r} given twice")
            given[key] = value
        if base is None:
            params = _dtype(given.pop("params", "f32"), "params")
            compute = _dtype(given.pop("compute"), "compute") if "compute" in given else params
            output = _dtype(given.pop("output"), "output") if "output" in given else None
            base = cls._defaults(params, compute, output)
        else:
            # a preset with overridden params/compute re-derives the dependent defaults
            if {"params", "compute"} & given.keys():
                params = _dtype(given.pop("params"), "params") if "params" in given else base["param_dtype"]
                compute = _dtype(given.pop("compute"), "compute") if "compute" in given else base["compute_dtype"]
                output = _dtype(given.pop("output"), "output") if "output" in given else None
                base = {
                    **base,
                    **{
                        k: v
                        for k, v in cls._defaults(params, compute, output).items()
                        if k in ("param_dtype", "compute_dtype", "output_dtype", "input_dtype", "norms")
                    },
                }
            elif "output" in given:
                base["output_dtype"] = _dtype(given.pop("output"), "output")
        values = dict(base)
        for key, value in given.items():
            values.update(_clause_value(key, value))
        values["rules"] = tuple(values.get("rules", ())) + tuple(rules)
        return cls(**values)

    def __str__(self) -> str:
        presets = _presets()
        for name in _PREFERRED:
            if presets[name] == self:
                return name
        # the preset with the same params/compute, plus the clauses that differ from it
        for name in _PREFERRED:
            preset = presets[name]
            if (preset.param_dtype, preset.compute_dtype) == (self.param_dtype, self.compute_dtype):
                clauses = self._clauses_against({f.name: getattr(preset, f.name) for f in fields(self)})
                if clauses is not None:
                    return ",".join([name, *clauses])
        head = [f"params={_short(self.param_dtype)}", f"compute={_short(self.compute_dtype)}"]
        clauses = self._clauses_against(self._defaults(self.param_dtype, self.compute_dtype))
        return ",".join(head + (clauses or []))

    def _clauses_against(self, base: dict[str, Any]) -> list[str] | None:
        """Clauses that turn ``base`` into this policy; None when rules cannot be expressed
        by appending to the base's rules."""
        out = []
        if self.output_dtype != base["output_dtype"]:
            out.append(f"output={_short(self.output_dtype)}")
        if self.buffer_dtype != base["buffer_dtype"]:
            out.append(f"buffers={_short(self.buffer_dtype) if self.buffer_dtype else 'none'}")
        if self.input_dtype != base["input_dtype"]:
            out.append(f"inputs={_short(self.input_dtype) if self.input_dtype else 'none'}")
        if self.loss_scale != base["loss_scale"]:
            out.append(f"loss_scale={'none' if self.loss_scale is None else self.loss_scale}")
        if self.master_weights != base["master_weights"]:
            out.append(f"master_weights={'on' if self.master_weights else 'off'}")
        if self.norms != base["norms"]:
            out.append(f"norms={_short(self.norms) if self.norms else 'none'}")
        if self.keep_in_fp32 != base["keep_in_fp32"]:
            out.append(f"keep_in_fp32={'on' if self.keep_in_fp32 else 'off'}")
        if self.cast_back != base["cast_back"]:
            out.append(f"cast_back={self.cast_back}")
        if self.fastpath != base["fastpath"]:
            out.append(f"fastpath={'on' if self.fastpath else 'off'}")
        if self.reduce_dtype != base["reduce_dtype"]:
            out.append(f"reduce={_short(self.reduce_dtype)}")
        base_rules = tuple(base["rules"])
        if self.rules[: len(base_rules)] == base_rules:
            out += [str(r) for r in self.rules[len(base_rules) :]]
        else:
            return None
        return out

    def with_rules(self, *rules: ModuleRule) -> Policy:
        """A copy with more module rules appended."""
        return replace(self, rules=self.rules + tuple(rules))

    def replace(self, **changes: Any) -> Policy:
        """A copy with fields changed (validated like a new policy)."""
        return replace(self, **changes)

    def describe(self) -> str:
        """One line in words: what this policy does."""
        if self.is_mixed:
            what = f"{_short(self.param_dtype)} weights, autocast to {_short(self.compute_dtype)}"
        else:
            what = f"{_short(self.param_dtype)} weights and compute"
        extras = []
        if self.norms:
            extras.append(f"norms as {_short(self.norms)} islands")
        if self.input_dtype:
            extras.append(f"inputs cast to {_short(self.input_dtype)}")
        if self.loss_scale:
            extras.append(f"{self.loss_scale} loss scaling")
        if not self.fastpath:
            extras.append("fused fast paths off")
        extras += [str(r) for r in self.rules]
        return "; ".join([what, f"outputs {_short(self.output_dtype)}", *extras])


def _clause_value(key: str, value: str) -> dict[str, Any]:
    low = value.lower()
    if key == "output":
        return {"output_dtype": _dtype(value, key)}
    if key == "reduce":
        return {"reduce_dtype": _dtype(value, key)}
    if key == "buffers":
        return {"buffer_dtype": None if low in ("none", "params") else _dtype(value, key)}
    if key == "inputs":
        return {"input_dtype": None if low in ("none", "off") else _dtype(value, key)}
    if key == "norms":
        return {"norms": None if low in ("none", "off", "follow") else _dtype(value, key)}
    if key == "loss_scale":
        if low in ("none", "off", "no"):
            return {"loss_scale": None}
        if low == "dynamic":
            return {"loss_scale": "dynamic"}
        try:
            scale = float(value)
        except ValueError:
            raise PolicyError(f"loss_scale={value!r} is not valid; valid: dynamic, none, or a number > 0") from None
        return {"loss_scale": scale}
    if key == "cast_back":
        if low not in ("saturate", "plain"):
            raise PolicyError(f"cast_back={value!r} is not valid; valid: plain, saturate")
        return {"cast_back": low}
    if key in ("master_weights", "keep_in_fp32", "fastpath"):
        if low not in _BOOL:
            raise PolicyError(f"{key}={value!r} is not valid; valid: off, on")
        return {key: _BOOL[low]}
    raise PolicyError(f"unknown clause {key!r}; valid clauses: {', '.join(_CLAUSES)}")  # pragma: no cover


_RULE_HEAD = re.compile(r"\s*(?:keep|out)\[")
# where a rule clause ends: ']=' and a dtype, then a comma or the end of the string
_RULE_TAIL = re.compile(r"\]\s*=\s*([^,\]]*?)\s*(?:,|$)")
_RULE_CLAUSE = re.compile(r"(keep|out)\[(.*)\]\s*=\s*(.*)", re.S)


def _split(text: str) -> list[str]:
    """Split on the commas between clauses. A rule's selector may hold commas, brackets and
    '=' (a regex): a ``keep[``/``out[`` clause runs to the first ``]=DTYPE`` that is followed by
    a comma or the end of the string."""
    parts: list[str] = []
    i, n = 0, len(text)
    while True:
        end = -1
        head = _RULE_HEAD.match(text, i)
        if head is not None:
            for tail in _RULE_TAIL.finditer(text, head.end()):
                if _dtypes.canonical(tail.group(1)) is not None:
                    end = tail.end()
                    break
        if end < 0:
            comma = text.find(",", i)
            end = n if comma < 0 else comma + 1
        clause = text[i:end]
        trailing = clause.endswith(",")
        parts.append(clause[:-1] if trailing else clause)
        i = end
        if i >= n:
            if trailing:
                parts.append("")
            break
    parts = [p.strip() for p in parts]
    if any(not p for p in parts) and len(parts) > 1:
        raise PolicyError(f"empty clause in {text!r} (two commas in a row, or a trailing comma)")
    return [p for p in parts if p]


_ECOSYSTEMS: dict[str, dict[str, str]] = {
    # prefix -> {string as that ecosystem writes it: castwise preset}
    # Lightning's *-true convert the whole module (norms included) and the inputs: castwise's
    # pure_* presets; its *-mixed only autocast, like castwise's
    "lightning": {
        **{k: k for k in ("32-true", "32", "64-true", "64", "16-mixed", "bf16-mixed")},
        "16-true": "pure_fp16",
        "bf16-true": "pure_bf16",
    },
    "accelerate": {"no": "no", "fp16": "fp16", "bf16": "bf16"},
    "openclip": {
        "fp32": "fp32",
        "amp": "amp",
        "amp_bf16": "amp_bf16",
        "amp_bfloat16": "amp_bfloat16",
        "fp16": "16-true",
        "bf16": "bf16-true",
        "pure_fp16": "pure_fp16",
        "pure_bf16": "pure_bf16",
    },
    "apex": {"O0": "O0", "O1": "O1", "O2": "O2", "O3": "O3"},
}


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _lookup_preset(text: str) -> Policy:
    presets = _presets()
    if ":" in text:
        prefix, _, name = text.partition(":")
        table = _ECOSYSTEMS.get(prefix.strip().lower())
        if table is None:
            raise PolicyError(f"unknown precision prefix {prefix!r}; valid prefixes: {', '.join(sorted(_ECOSYSTEMS))}")
        key = name.strip()
        key = key if key in table else key.upper() if key.upper() in table else key.lower()
        if key not in table:
            raise PolicyError(f"unknown {prefix} precision {name.strip()!r}; valid: {', '.join(sorted(table))}")
        return presets[table[key]]
    preset = presets.get(text) or presets.get(text.lower()) or presets.get(text.upper())
    if preset is None:
        raise PolicyError(
            f"unknown precision {text!r}{_did_you_mean(text, presets)}; valid presets: {', '.join(sorted(presets))}; "
            "or clauses like 'params=f32,compute=bf16,output=f32'"
        )
    return preset


# printed names, in order of preference when several presets mean the same policy
_PREFERRED = (
    "32-true",
    "64-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "pure_fp16",
    "pure_bf16",
    "O2",
    "O3",
)

_PRESET_CACHE: dict[str, Policy] = {}


def _presets() -> dict[str, Policy]:
    if _PRESET_CACHE:
        return _PRESET_CACHE
    d = Policy._defaults
    fp32 = Policy(**d(F32, F32))
    mixed16 = Policy(**{**d(F32, F16), "loss_scale": "dynamic"})
    mixedbf16 = Policy(**d(F32, BF16))
    true16 = Policy(**d(F16, F16))
    truebf16 = Policy(**d(BF16, BF16))
    pure16 = Policy(**{**d(F16, F16), "norms": None})
    purebf16 = Policy(**{**d(BF16, BF16), "norms": None})
    batchnorm_f32 = ModuleRule("class:torch.nn.modules.batchnorm._BatchNorm", F32)
    apex_o2 = Policy(
        **{
            **d(F16, F16, F32),
            "norms": None,
            "loss_scale": "dynamic",
            "master_weights": True,
            "rules": (batchnorm_f32,),
        }
    )
    # Apex O2/O3 patch forward to cast inputs to float16 and outputs to float32
    apex_o3 = Policy(**{**d(F16, F16, F32), "norms": None})
    table = {
        # Lightning
        "32-true": fp32,
        "32": fp32,
        "64-true": Policy(**d(F64, F64)),
        "64": Policy(**d(F64, F64)),
        "16-mixed": mixed16,
        "bf16-mixed": mixedbf16,
        "16-true": true16,
        "bf16-true": truebf16,
        # Accelerate --mixed_precision
        "no": fp32,
        "fp16": mixed16,
        "bf16": mixedbf16,
        # OpenCLIP --precision (its "fp16"/"bf16" are 16-true/bf16-true: see the docstring)
        "fp32": fp32,
        "amp": mixed16,
        "amp_bf16": mixedbf16,
        "amp_bfloat16": mixedbf16,
        "pure_fp16": pure16,
        "pure_bf16": purebf16,
        # Apex opt levels
        "O0": fp32,
        "O1": mixed16,
        "O2": apex_o2,
        "O3": apex_o3,
    }
    _PRESET_CACHE.update(table)
    return _PRESET_CACHE


# ---------------------------------------------------------------------------------------------
# resolving rules against a model


NORM_CLASS_NAMES = re.compile(r"(?i).*(LayerNorm|RMSNorm|GroupNorm|BatchNorm\d?d?|InstanceNorm\d?d?|LayerNormFp32)$")


def is_norm(module: nn.Module) -> bool:
    """Normalisation layers: torch's norm classes and library norms named like them
    (OpenCLIP's LayerNormFp32, transformers' T5LayerNorm/LlamaRMSNorm, ...) that own parameters
    or buffers and no child modules."""
    from torch import nn

    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)):
        return True
    if next(module.children(), None) is not None:
        return False
    if not any(True for _ in module.parameters(recurse=False)) and not any(True for _ in module.buffers(recurse=False)):
        return False
    return any(NORM_CLASS_NAMES.fullmatch(cls.__name__) for cls in type(module).__mro__)


def _keep_in_fp32_names(model: nn.Module, compute: torch.dtype) -> list[str]:
    """Entries of transformers' ``_keep_in_fp32_modules`` (honoured, as transformers does, only
    when running in float16) and ``_keep_in_fp32_modules_strict`` (float16 and bfloat16)."""
    attrs = {
        F16: ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"),
        BF16: ("_keep_in_fp32_modules_strict",),
    }.get(compute, ())
    names: list[str] = []
    for module in model.modules():
        for attr in attrs:
            keep = getattr(module, attr, None)
            if isinstance(keep, (list, tuple, set, frozenset)):
                names += [str(k) for k in keep]
    return sorted(set(names))


def _matches_segments(name: str, keep: Iterable[str]) -> str | None:
    """transformers' _keep_in_fp32_modules entries matched on whole dotted segments (transformers
    5.x matches substrings, so its ``wo`` also catches ``word_embeddings``)."""
    segments = name.split(".")
    for entry in keep:
        parts = entry.split(".")
        n = len(parts)
        if any(segments[i : i + n] == parts for i in range(len(segments) - n + 1)):
            return entry
    return None


@dataclass(frozen=True)
class Decision:
    """What a policy does to one module."""

    island: torch.dtype | None = None  # run as an island in this dtype
    island_reason: str | None = None  # "rule keep[...]", "_keep_in_fp32_modules 'wo'", "norms"
    output: torch.dtype | None = None  # cast floating outputs to this dtype
    output_reason: str | None = None


def resolve(policy: Policy, model: nn.Module) -> dict[str, Decision]:
    """Which modules of ``model`` are islands or get output casts under ``policy``.

    Raises RuleError when two user rules of one kind match one module with different dtypes.
    Only modules with a decision are in the result; the root is named ``""``.
    """
    keep_names = _keep_in_fp32_names(model, policy.compute_dtype) if policy.keep_in_fp32 else []
    out: dict[str, Decision] = {}
    for name, module in model.named_modules():
        island = island_reason = output = output_reason = None
        for kind in ("keep", "out"):
            hits = [r for r in policy.rules if r.kind == kind and r.matches(name, module)]
            dtypes = {r.dtype for r in hits}
            if len(dtypes) > 1:
                a, b = hits[0], next(r for r in hits if r.dtype != hits[0].dtype)
                raise RuleError(
                    f"module {name or '(root)'!r} ({type(module).__name__}) is matched by {a} and {b}, "
                    "which disagree; make one selector narrower or drop one rule"
                )
            if hits:
                if kind == "keep":
                    island, island_reason = hits[0].dtype, f"rule {hits[0]}"
                else:
                    output, output_reason = hits[0].dtype, f"rule {hits[0]}"
        if island is None and keep_names and name:
            entry = _matches_segments(name, keep_names)
            if entry is not None:
                island, island_reason = F32, f"_keep_in_fp32_modules {entry!r}"
        if island is None and policy.norms is not None and policy.norms != policy.compute_dtype and is_norm(module):
            island, island_reason = policy.norms, "norms"
        if island is not None and island == policy.param_dtype and not policy.is_mixed and island_reason == "norms":
            island = None
        if island is not None or output is not None:
            out[name] = Decision(island, island_reason, output, output_reason)
    # an island inside an island of the same dtype adds nothing: keep the outermost
    names = sorted(out, key=lambda n: n.count(".") if n else -1)
    for name in names:
        d = out[name]
        if d.island is None:
            continue
        parent = _enclosing_island(name, out)
        if parent is not None and out[parent].island == d.island:
            out[name] = Decision(None, None, d.output, d.output_reason)
            if out[name].output is None:
                del out[name]
    return out


def _enclosing_island(name: str, decisions: dict[str, Decision]) -> str | None:
    parts = name.split(".") if name else []
    for i in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:i])
        d = decisions.get(prefix)
        if d is not None and d.island is not None and prefix != name:
            return prefix
    return None
