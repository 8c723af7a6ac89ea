"""Megatron-LM launch scripts (``pretrain_gpt.sh``): the precision flags of the command line.

Semantics (NVIDIA/Megatron-LM megatron/training/arguments.py ``validate_args`` and
``_add_mixed_precision_args``; megatron/core/optimizer/optimizer_config.py):
- ``--bf16`` / ``--fp16``: ``params_dtype``; the model is wrapped in Float16Module (weights and
  compute in that dtype); the optimizer keeps main (master) params in ``--main-params-dtype``
  (fp32 default; fp16 with ``--use-precision-aware-optimizer``).
- gradients: with ``--bf16`` and ``--main-grads-dtype`` fp32 (the default), validate_args sets
  ``accumulate_allreduce_grads_in_fp32`` unless ``--grad-reduce-in-bf16``: the DDP grad buffer
  (core/distributed/param_and_grad_buffer.py) and its all-reduce are fp32. With ``--fp16``
  only ``--accumulate-allreduce-grads-in-fp32`` asks for that.
- Adam state: ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` (fp32 default; fp16, bf16, fp8 with
  the precision-aware optimizer, TE's FusedAdam).
- ``--loss-scale``: a static scale for fp16; unset, dynamic (``--initial-loss-scale``).
- float8 / NVFP4 GEMMs: the flags ``castwise.policy.vocab`` reads (``--fp8-format`` turns float8 on,
  ``--fp4-format`` NVFP4; a recipe flag alone is inert: CW213).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from castwise.errors import PolicyError
from castwise.lint.model import ConfigFile, Setting, Traced, dtype_of
from castwise.policy import vocab
from castwise.policy.float8 import Float8Recipe

__all__ = ["is_megatron", "read"]

FLAGS: frozenset[str] = frozenset(
    {
        "--bf16",
        "--fp16",
        "--main-params-dtype",
        "--main-grads-dtype",
        "--exp-avg-dtype",
        "--exp-avg-sq-dtype",
        "--use-precision-aware-optimizer",
        "--accumulate-allreduce-grads-in-fp32",
        "--grad-reduce-in-bf16",
        "--loss-scale",
        "--lr",
        "--global-batch-size",
        "--micro-batch-size",
        "--optimizer",
        *vocab.MEGATRON_VALUES,
        *vocab.MEGATRON_SWITCHES,
        *vocab.MEGATRON_OLD_FORMATS,
    }
)
_VALUED = frozenset(
    {
        "--main-params-dtype",
        "--main-grads-dtype",
        "--exp-avg-dtype",
        "--exp-avg-sq-dtype",
        "--loss-scale",
        "--lr",
        "--global-batch-size",
        "--micro-batch-size",
        "--optimizer",
        *vocab.MEGATRON_VALUES,
    }
)
_MARKERS = ("pretrain_gpt", "pretrain_bert", "pretrain_t5", "pretrain_mamba", "--tensor-model-parallel-size")
_SCHEME = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "fp8": "fp8"}


def is_megatron(text: str) -> bool:
    return any(m in text for m in _MARKERS)


def _logical_lines(text: str) -> list[tuple[str, int]]:
    """Lines joined across backslash continuations, each with the line it starts on."""
    out: list[tuple[str, int]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0] if not raw.lstrip().startswith("#") else ""
        if not buf:
            start = number
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((buf + line, start))
        buf = ""
    if buf:
        out.append((buf, start))
    return out


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split()  # an unbalanced quote: plain words still carry the flags


def read(text: str, shown: str) -> ConfigFile:
    """Every precision flag of the script's command lines (and of its ``ARGS=(...)`` arrays)."""
    settings: dict[str, Setting] = {}
    for line, number in _logical_lines(text):
        words = [w.strip("()\"'") for w in _words(line)]
        for i, word in enumerate(words):
            flag, _, inline = word.partition("=")
            if flag not in FLAGS:
                continue
            value: Any = True
            if flag in _VALUED:
                value = inline or (words[i + 1] if i + 1 < len(words) else "")
            if flag in vocab.MEGATRON_OLD_FORMATS:  # the older releases' --fp8-e4m3 / --fp8-hybrid
                settings["--fp8-format"] = Setting(flag, vocab.MEGATRON_OLD_FORMATS[flag], shown, number)
                continue
            settings[flag] = Setting(flag, value, shown, number)
    return ConfigFile(shown, "megatron", settings)


def _dtype(cf: ConfigFile, flag: str) -> tuple[str, tuple[Setting, ...]]:
    s = cf.get(flag)
    if s is None:
        return "float32", ()
    word = str(s.value).strip().lower()
    return ("fp8" if word == "fp8" else dtype_of(word) or "unknown"), (s,)


def _state(cf: ConfigFile, put: Any) -> None:
    avg, avg_src = _dtype(cf, "--exp-avg-dtype")
    sq, sq_src = _dtype(cf, "--exp-avg-sq-dtype")
    src = avg_src + sq_src
    note = "optimizer_config.py exp_avg_dtype / exp_avg_sq_dtype (TE FusedAdam with the precision-aware optimizer)"
    opt = cf.get("--optimizer")
    if opt is not None and str(opt.value).lower() == "sgd":
        avg, sq, src = "float32", "float32", (opt,)  # SGD's momentum lives beside the fp32 main params
    value = avg if avg == sq else f"exp_avg {_SCHEME.get(avg, avg)}, exp_avg_sq {_SCHEME.get(sq, sq)}"
    scheme = _SCHEME.get(avg, avg) if avg == sq else value
    put("optimizer_state", Traced(value, src, note))
    put("state_scheme", Traced(scheme, src, note))
    put("rounding", Traced("none", (), "Megatron's optimizers round to nearest"))


def contribute(cf: ConfigFile, put: Any) -> None:
    bf16, fp16 = cf.get("--bf16"), cf.get("--fp16")
    low = bf16 or fp16
    dt = "bfloat16" if bf16 is not None else "float16" if fp16 is not None else "float32"
    src = (low,) if low is not None else ()
    put("weights", Traced(dt, src, "params_dtype: Float16Module converts the model"))
    put("compute", Traced(dt, src, "the model runs in params_dtype"))
    master, msrc = _dtype(cf, "--main-params-dtype")
    put("master", Traced(master if low is not None else "none", msrc or src, "main_params_dtype (fp32 default)"))
    _state(cf, put)
    grads, gsrc = _dtype(cf, "--main-grads-dtype")
    fp32_flag, bf16_reduce = cf.get("--accumulate-allreduce-grads-in-fp32"), cf.get("--grad-reduce-in-bf16")
    asrc: tuple[Setting, ...] = ()
    if low is None:
        acc = "float32"
    elif bf16 is not None and bf16_reduce is None and grads == "float32":
        acc, asrc = "float32", (bf16, *gsrc)  # validate_args turns accumulate_allreduce_grads_in_fp32 on
    elif fp32_flag is not None:
        acc, asrc = "float32", (fp32_flag,)
    else:
        acc, asrc = dt, tuple(s for s in (low, bf16_reduce, *gsrc) if s is not None)
    note = "the DDP grad buffer (param_and_grad_buffer.py) accumulates and all-reduces in this dtype"
    put("gradients", Traced(acc, asrc, note), mechanism="accumulate")
    put("reduce", Traced(acc, asrc, note))
    ls = cf.get("--loss-scale")
    if fp16 is not None:
        scale = ls.value if ls is not None else None
        static = scale is not None and re.fullmatch(r"[0-9.eE+-]+", str(scale)) is not None
        put("loss_scaling", Traced(f"static:{scale}" if static else "dynamic", (ls or fp16,), "--loss-scale"))
    else:
        put("loss_scaling", Traced("none", src, "no loss scaling without --fp16"))
    put("device", Traced("cuda", (), "Megatron trains on GPUs"), weak=True)
    _gemms(cf, put)


def command_line(cf: ConfigFile) -> str:
    """The script's precision flags as one Megatron command line (what castwise.policy reads)."""
    words = []
    for flag, s in cf.settings.items():
        if flag in vocab.MEGATRON_VALUES:
            words += [flag, str(s.value)]
        elif flag in ("--bf16", "--fp16", *vocab.MEGATRON_SWITCHES):
            words.append(flag)
    return " ".join(words)


def _gemms(cf: ConfigFile, put: Any) -> None:
    fp4 = cf.get("--fp4-format") is not None
    fmt = cf.get("--fp4-format") or cf.get("--fp8-format")
    if fmt is None:
        return  # without a format Megatron runs no low-precision GEMMs (a recipe flag alone: CW213)
    recipe = cf.get("--fp4-recipe") if fp4 else cf.get("--fp8-recipe")
    scaling = str(recipe.value) if recipe is not None else ("nvfp4" if fp4 else "delayed")
    try:
        gemm = Float8Recipe.parse(scaling if fp4 else f"{scaling}:{fmt.value}")
    except PolicyError:
        return  # a custom recipe (its quantizer factory) or a value Megatron refuses: no format to name
    src = tuple(x for x in (fmt, recipe) if x is not None)
    put("compute", Traced(gemm.forward_dtype, src, f"Megatron's {gemm.describe()}"))
