"""The precision ledger's config rules (CW230-CW232): what the engines' settings do to the
update, the accumulated gradient and its reduction, read from the precision model."""

from __future__ import annotations

import math
from collections.abc import Sequence

from castwise._dtypes import short
from castwise.lint.model import ConfigFile, PrecisionModel, Setting, Traced, finding
from castwise.report import Finding

__all__ = ["accumulation_error", "run_checks"]

# bits of significand each storage dtype keeps (with the implicit bit): an update smaller than
# 2^-bits of a weight rounds away under round-to-nearest
_BITS = {"bfloat16": 8, "float16": 11}
_WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_LR_KEYS = {"hf-training-args": "learning_rate", "megatron": "--lr", "deepspeed": "optimizer.params.lr"}


def _lr(files: Sequence[ConfigFile]) -> tuple[float, Setting] | None:
    for cf in files:
        s = cf.get(_LR_KEYS.get(cf.format, ""))
        try:
            value = float(s.value) if s is not None and not isinstance(s.value, bool) else None
        except (TypeError, ValueError):
            value = None
        if s is not None and value is not None and value > 0:
            return value, s
    return None


def _src(*traced: Traced | None) -> list[Setting]:
    return [s for t in traced if t is not None for s in t.settings]


def _cw230(files: Sequence[ConfigFile], m: PrecisionModel) -> list[Finding]:
    w, master, rounding = m.weights, m.master, m.rounding
    # bf16 only: f16 weights without loss scaling or master copy are CW204/CW206's (their gradients
    # underflow before any update is rounded away)
    if w is None or w.value != "bfloat16" or master is None or rounding is None:
        return []
    if master.value not in ("none", w.value) or rounding.value != "none":
        return []
    bits = _BITS[w.value]
    lr = _lr(files)
    if lr is not None:
        where = (
            f"with lr={lr[0]:g} an Adam step (|update| ~ lr) is lost on every weight with |w| > {lr[0] * 2**bits:.3g}"
        )
        settings = [*_src(w, master, rounding), lr[1]]
    else:
        where = "every weight whose Adam step (|update| ~ lr) is under that is never changed"
        settings = _src(w, master, rounding)
    return [
        finding(
            "CW230",
            settings,
            f"the trained weights are stored in {short(w.value)} with no higher-precision master copy, "
            f"stochastic rounding or Kahan summation: an update below 2^-{bits} of a weight rounds away; {where}.",
            "Keep f32 master weights (DeepSpeed: drop bf16_master_weights_and_grads; HF: load in float32 and "
            "train with bf16=true autocast; torchtitan: training.dtype = float32), or use an optimizer with "
            "bf16 stochastic rounding (torchao AdamW8bit/4bit/Fp8 bf16_stochastic_round=True).",
        )
    ]


# CW152's floor (castwise.ledger.runtime): the relative error of a 16-bit gradient sum worth reporting
_LOST = 2.0**-7


def accumulation_error(n: int, dtype: str) -> float:
    """The expected relative error (in norm) of ``n`` similar micro-batch gradients summed in
    ``dtype`` under round-to-nearest: each addition rounds the running sum S_k by a uniform error
    of up to half its spacing, 2^-bits * 2^floor(log2 |S_k|), whose mean over a log-uniform
    mantissa is 2^-bits |S_k| / (2 ln 2); its standard deviation is that over sqrt(3). The errors
    are independent, so over S_k ~ k S_n / n they sum as sqrt(sum k^2) ~ n^1.5 / sqrt(3):
    2^-bits * sqrt(n) / (6 ln 2). Measured on an MLP in bf16 (tests/lint/test_ledger_rules.py):
    0.31% at 32 micro-batches, 1.13% at 128; the model says 0.53% and 1.06%."""
    return 2.0 ** -_BITS[dtype] * math.sqrt(n) / (6 * math.log(2))


def _cw231(m: PrecisionModel) -> list[Finding]:
    g, steps = m.gradients, m.accumulate_steps
    if g is None or g.value not in _BITS or steps is None or not steps.value.isdigit() or int(steps.value) < 2:
        return []
    n = int(steps.value)
    err = accumulation_error(n, g.value)
    # reported from the error castwise run's CW152 reports measured (2^-7): bf16 from ~70
    # micro-batches, f16 from ~4400
    if err < _LOST:
        return []
    return [
        finding(
            "CW231",
            _src(g, steps),
            f"gradients are accumulated in {short(g.value)} over {n} micro-batches: every addition rounds the "
            f"running sum to {_BITS[g.value]} significant bits, and the roundings add up to an expected "
            f"{err:.1%} relative error of the summed gradient (2^-{_BITS[g.value]} * sqrt({n}) / (6 ln 2): "
            "round-to-nearest's error per addition, summed over the additions).",
            "Accumulate in float32: DeepSpeed data_types.grad_accum_dtype = fp32, Megatron "
            "--accumulate-allreduce-grads-in-fp32, torch param.grad_dtype = torch.float32.",
        )
    ]


def _cw232(m: PrecisionModel) -> list[Finding]:
    g, r, c = m.gradients, m.reduce, m.compute
    if g is None or r is None or c is None or any(t.value not in _WIDTH for t in (g, r, c)):
        return []
    # gradients computed in the reduce dtype (FSDP param_dtype, autocast, a bf16 engine) carry no more
    # precision than the reduce keeps: only gradients computed wider than the reduce lose some
    if _WIDTH[r.value] >= _WIDTH[g.value] or _WIDTH[r.value] >= _WIDTH[c.value]:
        return []
    return [
        finding(
            "CW232",
            _src(g, r),
            f"gradients are kept in {short(g.value)} but reduced across ranks in {short(r.value)}: the "
            f"all-reduce rounds every rank's gradient (and their sum) to {short(r.value)}, the precision the "
            f"{short(g.value)} gradients were kept for.",
            "Reduce in the gradients' dtype: DeepSpeed communication_data_type = fp32, torchtitan "
            "mixed_precision_reduce = float32, FSDP2 MixedPrecisionPolicy(reduce_dtype=torch.float32).",
            severity="warning",
        )
    ]


def run_checks(files: Sequence[ConfigFile], model: PrecisionModel) -> list[Finding]:
    return [*_cw230(files, model), *_cw231(model), *_cw232(model)]
