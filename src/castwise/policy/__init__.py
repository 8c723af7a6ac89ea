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
module converted, norms included, and torch's default dtype set to the low dtype while a step
runs: castwise's ``pure_fp16``/``pure_bf16`` with ``keep_in_fp32=off,default_dtype=f16|bf16``);
``lightning:64-true`` is ``64-true,default_dtype=f64``; ``lightning:*-mixed`` are the
``*-mixed`` presets (autocast only).

More strings other tools write: ``16`` (and the int 16: Lightning's ``16-mixed``); Megatron's
``--bf16`` / ``--fp16`` (half weights and norms, inputs cast, float32 outputs and main params;
``--fp16`` adds dynamic loss scaling and reduces in f16) with ``--fp8-format e4m3|hybrid`` and
``--fp8-recipe``; torchtitan's ``mixed_precision_param=bfloat16,mixed_precision_reduce=float32``
(FSDP2's MixedPrecisionPolicy: ``bf16-mixed,output=bf16``), read by ``castwise.policy.vocab``.
FP8 is a recipe on a base precision (``fp8=SCALING[:FORMAT]``, ``castwise.policy.float8``):
``fp8`` = ``bf16-mixed,fp8=tensorwise`` (Accelerate's), ``mxfp8`` = ``bf16-mixed,fp8=mxfp8``,
``transformer-engine`` = ``lightning:bf16-true,fp8=delayed`` (``-float16``: f16), and a float8
format alone (``float8_e4m3fn``, ``e4m3``, ``e5m2``...) is ``32-true,fp8=tensorwise[:e5m2]``.
A bare dtype name (``bfloat16``, ``float16``, ``half``) is refused with both readings
(``bf16-mixed``: autocast, as nanoGPT's ``dtype=`` or timm's ``--amp-dtype``; ``bf16-true``:
weights, as transformers' ``torch_dtype=``) unless a prefix says which: ``nanogpt:bfloat16``,
``timm:bfloat16`` (autocast), ``hf:bfloat16`` (``pure_bf16``).

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
- ``cast_complex=on|off`` cast complex parameters and buffers to the storage dtype as
  ``module.to(dtype)`` does, dropping their imaginary part (default off: kept complex; on under
  ``lightning:*-true``, whose precision plugins convert the module with ``module.to(dtype)``)
- ``converted=on|off`` the model's tensors are as a framework converted them already (Lightning's
  convert_module, run at setup): apply casts no parameter or buffer (default off; ``castwise run``
  adds it to a Lightning ``*-true`` precision, so a module made after the conversion is seen: CW118)
- ``cast_back=saturate|plain`` how an island's output returns to float16: clamped to float16's
  finite range first (default), or plainly cast
- ``reduce=DT`` dtype gradients are reduced in across ranks (FSDP2's ``reduce_dtype``, DeepSpeed's
  ``communication_data_type``; default float32: a sum over many ranks loses bits in bf16/f16)
- ``default_dtype=DT|none`` torch's default dtype while the model runs, restored after (default
  none: left as it is). Tensors the forward makes without a dtype (``torch.zeros(n)``) come out
  in it, as under Lightning's ``*-true``, which set it around each step
- ``fp8=SCALING[:FORMAT]|none`` float8 GEMMs in the Linears on top of the policy (default none):
  SCALING tensorwise, rowwise, delayed, blockwise or mxfp8; FORMAT e4m3, e5m2 or hybrid
- ``fastpath=on|off`` allow fused TransformerEncoderLayer/MultiheadAttention fast paths while the
  model runs (default on, torch's default)
- ``keep[SELECTOR]=DT`` run matching modules as islands in DT: parameters and buffers stored in
  DT, floating inputs cast to DT, autocast off inside, outputs cast back to the compute dtype
- ``out[SELECTOR]=DT`` cast matching modules' floating outputs to DT

SELECTOR: a glob on dotted name segments (``*`` is one segment, ``**`` any number: ``*.wo``
matches ``encoder.wo`` only, ``**.wo`` a ``wo`` at any depth, ``encoder.block.*.layer.1.DenseReluDense.wo``
each T5 encoder block's),
``re:REGEX`` (full match on the qualified name), or ``class:NAME`` (the module's class or a base
class, by name or dotted path, e.g. ``class:LayerNorm`` or ``class:torch.nn.LayerNorm``).
In Python a rule may also select by a class object or a predicate ``(name, module) -> bool``;
predicate rules print as ``fn:qualname`` and cannot be parsed back.

Rule precedence: a user's ``keep``/``out`` rules, then the model's ``_keep_in_fp32_modules``,
then the ``norms`` default. Two user rules of one kind that match the same module with
different dtypes are an error naming both. A rule on a module inside an island applies to
that inner module. A rule that matches no module of the model is almost always a typo:
``apply`` warns, naming the selector that would match, and the audit reports it (CW123).

Layout: ``fields`` declares each field once (clause key, parser, printer, default, validation),
``grammar`` splits, reads and prints policy strings, ``presets`` holds what every ecosystem's
string means (torch-free: ``castwise.lint`` reads it), ``selectors`` the module rules, ``core``
the ``Policy`` value. What a policy does to a given model (``resolve``, ``is_norm``) lives
beside ``apply``, in ``castwise.applied.inspection``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from castwise.policy.selectors import ModuleRule, Predicate, RuleKind, Selector

if TYPE_CHECKING:
    from castwise.policy.core import LossScale, Policy

__all__ = ["LossScale", "ModuleRule", "Policy", "Predicate", "RuleKind", "Selector"]

# the Policy value holds torch dtypes: imported when first used, so that the torch-free parts of
# this package (presets, fields, grammar, selectors) load without torch
_LAZY: dict[str, str] = {
    "Policy": "castwise.policy.core",
    "LossScale": "castwise.policy.core",
    # model inspection moved beside apply (castwise.applied.inspection); kept here for importers
    "Decision": "castwise.applied.inspection",
    "NORM_CLASS_NAMES": "castwise.applied.inspection",
    "is_norm": "castwise.applied.inspection",
    "resolve": "castwise.applied.inspection",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'castwise.policy' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
