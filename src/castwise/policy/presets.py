"""What each ecosystem's precision string means (torch-free: lint-config reads it too).

One table for castwise's presets and for the strings Lightning, Accelerate, OpenCLIP and Apex
users write. A preset is its storage and compute dtypes (canonical names) plus the castwise
clauses that complete it; ``Preset.text`` is the clause string ``Policy.parse`` builds it
from. ``castwise.lint`` reads the same table for what a Lightning ``trainer.precision`` or an
Accelerate ``mixed_precision`` does to weights, compute and loss scaling.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from castwise import _dtypes
from castwise._dtypes import short
from castwise.errors import PolicyError
from castwise.policy.float8 import Float8Recipe

__all__ = [
    "ACCELERATE",
    "ECOSYSTEMS",
    "ENGINES",
    "LIGHTNING",
    "LIGHTNING_ALIASES",
    "LIGHTNING_CLAUSES",
    "PREFERRED",
    "PRESETS",
    "Engine",
    "Preset",
    "accelerate",
    "did_you_mean",
    "ecosystem_clauses",
    "lightning",
    "lookup",
]


@dataclass(frozen=True)
class Preset:
    """A precision string's meaning: ``params``/``compute``/``output`` canonical dtype names
    (``output`` None: the default, f32 when mixed else compute), the loss scaling
    (``"dynamic"`` or None) and further castwise clauses."""

    params: str
    compute: str
    output: str | None = None
    loss_scale: str | None = None
    clauses: tuple[str, ...] = ()
    fp8: str | None = None  # a float8 recipe on top (castwise.policy.float8: "tensorwise", "delayed"...)

    @property
    def loss_scaling(self) -> str:
        """As lint-config's precision model says it: ``dynamic`` or ``none``."""
        return self.loss_scale or "none"

    @property
    def text(self) -> str:
        """The clause string that parses to this preset's policy."""
        head = [f"params={_dtypes.short(self.params)}", f"compute={_dtypes.short(self.compute)}"]
        if self.output is not None:
            head.append(f"output={_dtypes.short(self.output)}")
        if self.loss_scale is not None:
            head.append(f"loss_scale={self.loss_scale}")
        return ",".join([*head, *self.clauses, *([f"fp8={self.fp8}"] if self.fp8 is not None else [])])

    @property
    def float8(self) -> Float8Recipe | None:
        return Float8Recipe.parse(self.fp8) if self.fp8 is not None else None

    @property
    def gemm(self) -> str:
        """The dtype the Linears' matmuls take their inputs in: the float8 recipe's forward format,
        else the compute dtype (lint-config's ``compute``)."""
        recipe = self.float8
        return recipe.forward_dtype if recipe is not None else self.compute


_FP32 = Preset("float32", "float32")
_FP64 = Preset("float64", "float64")
_MIXED16 = Preset("float32", "float16", loss_scale="dynamic")
_MIXEDBF16 = Preset("float32", "bfloat16")
_TRUE16 = Preset("float16", "float16")  # norms as f32 islands, inputs cast: the derived defaults
_TRUEBF16 = Preset("bfloat16", "bfloat16")
_PURE16 = Preset("float16", "float16", clauses=("norms=none",))
_PUREBF16 = Preset("bfloat16", "bfloat16", clauses=("norms=none",))
# a float8 format named alone: float8 GEMMs (per-tensor scales) on float32, so that only float8's
# rounding differs from float32 (what compare and forecast have always meant by it)
_F8E4M3 = Preset("float32", "float32", fp8="tensorwise")
_F8E5M2 = Preset("float32", "float32", fp8="tensorwise:e5m2")
# Lightning's TransformerEnginePrecision: TE layers, module.to(weights_dtype), inputs cast, torch's
# default dtype set while a step runs, te.fp8_autocast with DelayedScaling() (HYBRID format)
_LIGHTNING_TRUE = ("norms=none", "keep_in_fp32=off", "cast_complex=on")


@dataclass(frozen=True)
class Engine:
    """What an engine does to a float32 model told to train in a 16-bit dtype, as its code runs it:
    the parameters cast (no autocast anywhere: ops run in the parameters' dtype, cross-entropy
    included), and what else it casts or keeps. The one model the audit, compare and tune read
    (through the presets below), so that they measure the program the engine runs."""

    casts_buffers: bool  # floating buffers cast with the parameters
    keeps_nonpersistent: bool  # buffers outside the state dict stay as the model built them
    casts_inputs: bool  # floating inputs cast to the dtype on the way in
    master_weights: bool  # the optimizer steps float32 copies
    keep_in_fp32: bool  # a model's _keep_in_fp32_modules honoured
    f16_loss_scale: str | None = None  # what float16 adds

    def preset(self, dtype: str) -> Preset:
        clauses = ["norms=none"]  # the engine converts norms with everything else
        # buffers the engine does not cast stay as the model made them (a bf16 rotary table too)
        clauses += [] if self.casts_buffers else ["keep_buffers=on"]
        clauses += ["keep_nonpersistent=on"] if self.keeps_nonpersistent else []
        clauses += [] if self.casts_inputs else ["inputs=none"]
        clauses += ["master_weights=on"] if self.master_weights else []
        clauses += [] if self.keep_in_fp32 else ["keep_in_fp32=off"]
        scale = self.f16_loss_scale if dtype == "float16" else None
        # no engine casts the outputs: castwise's float32 output is exact over 16-bit ones, so the numbers
        # are the engine's, and a float32 loss the model computes (transformers' upcast) stays float32
        return Preset(dtype, dtype, "float32", loss_scale=scale, clauses=tuple(clauses))


ENGINES: dict[str, Engine] = {
    # transformers' from_pretrained(dtype=...): the model is built under torch.set_default_dtype(dtype)
    # (modeling_utils.local_torch_dtype) and the checkpoint loaded into it; buffers outside the state
    # dict are re-made by _init_weights as the model's code makes them (the rotary inv_freq in float32:
    # _move_missing_keys_from_meta_to_device, _init_weights' RotaryEmbedding branch);
    # _get_dtype_plan keeps _keep_in_fp32_modules (float16) and _keep_in_fp32_modules_strict (both) in
    # float32. Inputs are the caller's (input_ids; vision models cast pixel_values to their weights)
    "hf": Engine(
        casts_buffers=True, keeps_nonpersistent=True, casts_inputs=False, master_weights=False, keep_in_fp32=True
    ),
    # FSDP2 fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=dt)): float32 shards all-gathered in
    # dt, no autocast, buffers left as they are, cast_forward_inputs=True casts floating inputs,
    # output_dtype=None leaves outputs as computed; the optimizer steps the float32 shards
    "fsdp2": Engine(
        casts_buffers=False, keeps_nonpersistent=False, casts_inputs=True, master_weights=True, keep_in_fp32=False
    ),
    # DeepSpeed bf16/fp16 (runtime/engine.py _configure_distributed_model, _cast_module_mixed_precision):
    # parameters cast, buffers kept unless buffer_dtype is set, inputs cast only by fp16.auto_cast (off
    # by default), no autocast unless torch_autocast is set; float32 master weights in its optimizers,
    # a dynamic loss scale for fp16 (loss_scale 0)
    "deepspeed": Engine(
        casts_buffers=False,
        keeps_nonpersistent=False,
        casts_inputs=False,
        master_weights=True,
        keep_in_fp32=False,
        f16_loss_scale="dynamic",
    ),
}
# each engine's presets by the dtype name, e.g. "fsdp2-bf16" (what fsdp2:bfloat16 stands for)
_ENGINE_PRESETS: dict[str, Preset] = {
    f"{engine}-{short(dtype)}": model.preset(dtype)
    for engine, model in ENGINES.items()
    for dtype in ("bfloat16", "float16")
}

PRESETS: dict[str, Preset] = {
    # Lightning
    "32-true": _FP32,
    "32": _FP32,
    "64-true": _FP64,
    "64": _FP64,
    "16-mixed": _MIXED16,
    "bf16-mixed": _MIXEDBF16,
    "16-true": _TRUE16,
    "bf16-true": _TRUEBF16,
    # Accelerate --mixed_precision
    "no": _FP32,
    "fp16": _MIXED16,
    "bf16": _MIXEDBF16,
    # OpenCLIP --precision (its "fp16"/"bf16" are 16-true/bf16-true: see castwise.policy)
    "fp32": _FP32,
    "amp": _MIXED16,
    "amp_bf16": _MIXEDBF16,
    "amp_bfloat16": _MIXEDBF16,
    "pure_fp16": _PURE16,
    "pure_bf16": _PUREBF16,
    # Apex opt levels; O2/O3 patch forward to cast inputs to float16 and outputs to float32
    "O0": _FP32,
    "O1": _MIXED16,
    "O2": Preset(
        "float16",
        "float16",
        "float32",
        "dynamic",
        ("norms=none", "master_weights=on", "keep[class:torch.nn.modules.batchnorm._BatchNorm]=f32"),
    ),
    "O3": Preset("float16", "float16", "float32", clauses=("norms=none",)),
    "16": _MIXED16,  # Lightning's alias, bare like "32" and "64"
    # FP8 recipes (castwise.policy.float8): bf16 autocast plus float8 GEMMs in the Linears, as
    # Accelerate's fp8 runs it (its AO backend, torchao's tensorwise Float8LinearConfig) and
    # torchtitan's float8 / mx converters over bf16
    "fp8": Preset("float32", "bfloat16", fp8="tensorwise"),
    "mxfp8": Preset("float32", "bfloat16", fp8="mxfp8"),
    **{name: _F8E4M3 for name in ("float8_e4m3fn", "f8e4m3fn", "e4m3", "e4m3fn", "fp8_e4m3", "float8")},
    **{name: _F8E5M2 for name in ("float8_e5m2", "f8e5m2", "e5m2", "fp8_e5m2")},
    "transformer-engine": Preset(
        "bfloat16", "bfloat16", clauses=(*_LIGHTNING_TRUE, "default_dtype=bf16"), fp8="delayed"
    ),
    "transformer-engine-float16": Preset(
        "float16", "float16", clauses=(*_LIGHTNING_TRUE, "default_dtype=f16"), fp8="delayed"
    ),
    # Megatron-LM: Float16Module converts the model (norms included) and the first stage's inputs,
    # returns float32 from the last stage; the optimizer keeps float32 main params. --bf16 reduces
    # gradients in float32 (accumulate_allreduce_grads_in_fp32 is forced on), --fp16 in float16
    # with a DynamicGradScaler (no --loss-scale given)
    "--bf16": Preset("bfloat16", "bfloat16", "float32", clauses=("norms=none", "master_weights=on")),
    "--fp16": Preset("float16", "float16", "float32", "dynamic", ("norms=none", "master_weights=on", "reduce=f16")),
    **_ENGINE_PRESETS,
}

# printed names, in order of preference when several presets mean the same policy
PREFERRED: tuple[str, ...] = (
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
    "fp8",
    "mxfp8",
    "float8_e4m3fn",
    "float8_e5m2",
    "transformer-engine",
    "transformer-engine-float16",
    "--bf16",
    "--fp16",
    *_ENGINE_PRESETS,
)

# Lightning's shorthands for its precision strings (accelerator_connector's alias conversion,
# plus "half"/"double")
LIGHTNING_ALIASES: dict[str, str] = {
    "16": "16-mixed",
    "32": "32-true",
    "64": "64-true",
    "bf16": "bf16-mixed",
    "half": "16-true",
    "double": "64-true",
}

# Lightning's *-true convert the whole module (norms included) and the inputs: castwise's pure_*
# presets; its *-mixed only autocast, like castwise's
LIGHTNING: dict[str, str] = {
    **{
        k: k
        for k in ("32-true", "64-true", "16-mixed", "bf16-mixed", "transformer-engine", "transformer-engine-float16")
    },
    "16-true": "pure_fp16",
    "bf16-true": "pure_bf16",
}
# ... and what a preset does not say: Lightning's HalfPrecision and DoublePrecision set torch's
# default dtype around each step (forward_context), and their module.to(dtype) ignores a model's
# _keep_in_fp32_modules; the half ones' module.to(dtype) casts complex buffers to the real dtype
# too (convert_module in lightning/{fabric,pytorch}/plugins/precision/half.py), where 64-true's
# module.double() (double.py) casts floating tensors only
LIGHTNING_CLAUSES: dict[str, tuple[str, ...]] = {
    "16-true": ("keep_in_fp32=off", "default_dtype=f16", "cast_complex=on"),
    "bf16-true": ("keep_in_fp32=off", "default_dtype=bf16", "cast_complex=on"),
    "64-true": ("default_dtype=f64",),
}
ACCELERATE: dict[str, str] = {"no": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
# projects whose setting is a bare dtype name, by canonical name: nanoGPT's dtype= and timm's
# --amp-dtype pick the autocast dtype (float16 with a GradScaler); transformers' torch_dtype=
# loads the weights in it (norms too; _keep_in_fp32_modules stay float32); the engines (ENGINES)
# cast the weights to it
DTYPE_SETTINGS: dict[str, dict[str, str]] = {
    "nanogpt": {"float32": "32-true", "bfloat16": "bf16-mixed", "float16": "16-mixed"},
    "timm": {"float32": "32-true", "bfloat16": "bf16-mixed", "float16": "16-mixed"},
    **{engine: {"float32": "32-true", "bfloat16": f"{engine}-bf16", "float16": f"{engine}-f16"} for engine in ENGINES},
}

ECOSYSTEMS: dict[str, dict[str, str]] = {
    # prefix -> {string as that ecosystem writes it: castwise preset}
    "lightning": {**LIGHTNING, **{k: LIGHTNING[v] for k, v in LIGHTNING_ALIASES.items()}},
    "accelerate": ACCELERATE,
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
    "megatron": {"--bf16": "--bf16", "--fp16": "--fp16", "bf16": "--bf16", "fp16": "--fp16"},
    **DTYPE_SETTINGS,
}


def lightning(precision: object) -> Preset | None:
    """What a Lightning ``precision`` value does (``16``, ``"bf16-mixed"``...); None: unknown."""
    text = str(precision).strip().lower()
    name = LIGHTNING.get(LIGHTNING_ALIASES.get(text, text))
    return PRESETS[name] if name is not None else None


def accelerate(mixed_precision: str) -> Preset | None:
    """What an Accelerate ``mixed_precision`` value does (``no``, ``fp16``, ``bf16``); None: unknown."""
    name = ACCELERATE.get(mixed_precision.strip().lower())
    return PRESETS[name] if name is not None else None


def ecosystem_clauses(text: str) -> tuple[str, ...]:
    """The clauses a prefixed precision string adds to its preset (``"lightning:bf16-true"`` ->
    ``("keep_in_fp32=off", "default_dtype=bf16")``); () for every other string."""
    prefix, colon, name = text.partition(":")
    if not colon or prefix.strip().lower() != "lightning":
        return ()
    key = name.strip().lower()
    return LIGHTNING_CLAUSES.get(LIGHTNING_ALIASES.get(key, key), ())


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _bare_dtype(text: str, name: str) -> PolicyError:
    """A bare bf16/f16 dtype name says which dtype but not whether weights or autocast use it."""
    mixed, true = ("bf16-mixed", "bf16-true") if name == "bfloat16" else ("16-mixed", "16-true")
    hf = DTYPE_SETTINGS["hf"][name]
    return PolicyError(
        f"precision {text!r} is a bare dtype name, which reads two ways: {mixed!r} (float32 weights, "
        f"{short(name)} autocast: what nanoGPT's dtype= and timm's --amp-dtype mean) or {true!r} "
        f"(weights stored in {short(name)}: what transformers' torch_dtype= means); write one of them, "
        f"or say whose setting it is: nanogpt:{name} or timm:{name} (= {mixed}), hf:{name} (= {hf}: "
        "transformers converts the norms too)"
    )


def _prefixed(prefix: str, name: str) -> str:
    table = ECOSYSTEMS.get(prefix.strip().lower())
    if table is None:
        raise PolicyError(f"unknown precision prefix {prefix!r}; valid prefixes: {', '.join(sorted(ECOSYSTEMS))}")
    key = name.strip()
    if prefix.strip().lower() in DTYPE_SETTINGS:
        key = _dtypes.canonical(key) or key  # any spelling of the dtype: torch.bfloat16, bf16, half
    key = key if key in table else key.upper() if key.upper() in table else key.lower()
    if key not in table:
        raise PolicyError(f"unknown {prefix} precision {name.strip()!r}; valid: {', '.join(sorted(table))}")
    return table[key]


def lookup(text: str) -> str:
    """The castwise preset name a precision string stands for (``"openclip:bf16"`` ->
    ``"bf16-true"``); PolicyError listing the valid ones when there is none, and spelling out
    both readings of a bare ``bfloat16``/``float16``."""
    if ":" in text:
        prefix, _, name = text.partition(":")
        return _prefixed(prefix, name)
    for key in (text, text.lower(), text.upper()):
        if key in PRESETS:
            return key
    dtype = _dtypes.canonical(text)
    if dtype is not None and _dtypes.is_low(dtype):
        raise _bare_dtype(text.strip(), dtype)
    if dtype in ("float32", "float64"):
        return "32-true" if dtype == "float32" else "64-true"  # one reading: nothing narrower to autocast to
    raise PolicyError(
        f"unknown precision {text!r}{did_you_mean(text, PRESETS)}; valid presets: {', '.join(sorted(PRESETS))}; "
        "or clauses like 'params=f32,compute=bf16,output=f32'"
    )
