"""``castwise.forecast``: where a narrower dtype would overflow or flush to zero, from one run.

The model runs once in its current precision (or under ``policy``) on real tensors. Every op's
floating output, forward and backward, is reduced as it is made (no activation kept) to its
largest magnitude and a histogram of powers of two, per module and phase. From these:

- overflow *origins*: ops whose output passes the target's largest finite value while their
  inputs are within it (a real target run makes Inf exactly there; later ops only inherit it),
  with the margin in powers of two (CW310);
- the share of non-zero values below half the target's smallest subnormal, which the target
  rounds to zero: activations (CW311) and gradients (CW312, with the loss scale that lifts them);
- for float8 targets, each Linear's GEMM operands scored as each recipe's scaling sees them, each
  of its GEMMs by the error its result features get under the target's recipe
  (``castwise.float8.score``), and layers to leave out of float8 (CW313): castwise's filter, the
  one apply uses (``castwise.float8.convert``), and the numbers (``float8_leaveout``), as a
  castwise policy and a torchao ``module_filter_fn``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from castwise._dtypes import canonical, name_of, short_of
from castwise.errors import AuditError, PolicyError
from castwise.float8 import convert, score
from castwise.numerics import _run
from castwise.numerics import float8_leaveout as f8l
from castwise.numerics.locate import MOST_ISLANDS, finite_with, keeps, real_run
from castwise.numerics.ranges import HIST_LO, RangeObserver, RangeRecord
from castwise.numerics.rows import forecast_rows
from castwise.policy import Policy
from castwise.policy.float8 import Float8Recipe
from castwise.report import Finding, Report
from castwise.rules.audit._text import where
from castwise.run import Inputs, RunRequest
from castwise.trace.events import as_mode
from castwise.trace.fake import on_meta

# a bare dtype name is a format, which is all forecast needs: both readings Policy.parse spells
# out for "bfloat16" (autocast or weights) forecast the same format
FORMATS: dict[str, str] = {"bfloat16": "bfloat16", "float16": "float16"}
THRESHOLD = 0.01  # the share of non-zero values flushed to zero that is worth a finding


@dataclass(frozen=True)
class Target:
    dtype: torch.dtype
    max: float
    flush_log2: float  # log2 of half the smallest subnormal: magnitudes below it round to zero
    recipe: Float8Recipe | None = None  # float8 targets: the recipe whose scaling and kernels judge CW313

    @property
    def name(self) -> str:
        return short_of(self.dtype)

    @property
    def float8(self) -> bool:
        return "float8" in str(self.dtype)


def target_format(target: Any) -> str:
    """The narrowest format a precision runs in (its float8 recipe's forward format, else its
    compute dtype): any string ``Policy.parse`` reads, a ``Policy``, or a bare dtype name."""
    key = str(target).strip() if isinstance(target, str) else target
    name = FORMATS.get(canonical(key) or "") if isinstance(key, str) else None
    if name is not None:
        return name
    try:
        policy = Policy.parse(key)
    except PolicyError as e:
        raise AuditError(f"target={target!r} is not valid: {e}") from None
    recipe: Float8Recipe | None = policy.float8
    if recipe is not None:
        return recipe.forward_dtype
    low = name_of(policy.compute_dtype)
    if low not in FORMATS:
        raise AuditError(
            f"target={target!r} computes in {short_of(policy.compute_dtype)}: nothing narrower to forecast; "
            "valid: a precision that computes in bf16, f16 or float8 (16-mixed, bf16-true, fp8, float8_e5m2, ...)"
        )
    return low


def target_recipe(target: Any) -> Float8Recipe | None:
    """The float8 recipe a target trains with ("fp8", "mxfp8", "bf16-mixed,fp8=rowwise", a bare
    float8 dtype: tensorwise in it); None for a 16-bit target."""
    key = str(target).strip() if isinstance(target, str) else target
    if isinstance(key, str) and canonical(key) in FORMATS:
        return None
    try:
        return Policy.parse(key).float8
    except PolicyError:
        return None


def parse_target(target: Any) -> Target:
    dtype = getattr(torch, target_format(target))
    fi = torch.finfo(dtype)
    sub = float(fi.smallest_normal) * float(fi.eps)
    recipe = target_recipe(target) if "float8" in str(dtype) else None
    return Target(dtype, float(fi.max), math.log2(sub) - 1, recipe)


def _flush_share(hist: list[float], flush_log2: float) -> tuple[float, float]:
    """(share of non-zero values that flush, log2 of the smallest non-zero magnitude's bin)."""
    total = sum(hist)
    if not total:
        return 0.0, math.nan
    # bin i holds [2**(LO+i), 2**(LO+i+1)): it flushes whole when its top is at or below the line
    cut = math.floor(flush_log2) - HIST_LO
    flushed = sum(hist[: max(cut, 0)])
    lowest = next(i for i, c in enumerate(hist) if c)
    return flushed / total, float(HIST_LO + lowest)


def _loss_scale(hist: list[float], flush_log2: float, absmax: float, tmax: float) -> int:
    """The power of two that lifts all but THRESHOLD of the gradients above the flush line
    without pushing the largest past the target's maximum (0: none helps)."""
    total = sum(hist) or 1.0
    headroom = math.floor(math.log2(tmax / absmax)) if absmax > 0 else 64
    for k in range(1, max(headroom, 0) + 1):
        if _flush_share(hist, flush_log2 - k)[0] < THRESHOLD:
            return k
    return max(min(headroom, 24), 0) if sum(hist) / total else 0


_LIBRARIES = ("torch", "transformers", "timm", "torchvision", "open_clip")
# LayerNorm, BatchNorm2d, LlamaRMSNorm, LayerNorm2d; not Conv2dNormActivation (a conv block)
_NORM = re.compile(r"Norm(\d+d)?$")


def computes_in_float32(module: nn.Module) -> bool:
    """Normalisation layers of torch and the model libraries compute in float32 inside (fused
    kernels accumulate in float32; transformers' and timm's norms upcast explicitly): their
    internal intermediates are not stored in the target dtype. A user's own norm is not assumed to."""
    cls = type(module)
    return _NORM.search(cls.__name__) is not None and cls.__module__.split(".")[0] in _LIBRARIES


# float16 and bfloat16 targets: a float32 model runs as float64, which stands for the target
STAND_IN = torch.float64


def stand_in(model: nn.Module, inputs: Inputs, t: Target, policy: Any, layerwise: bool, device: str) -> bool:
    """Whether forecast runs a float32 model with ``STAND_IN`` standing for the 16-bit target: its
    float32 parameters, buffers and inputs held in float64 for the run, so that the model's own
    dtype flow is the target run's. Every cast the model makes to float32 (``x.float()`` in a norm,
    ``upcast_attention``), every ``dtype=torch.float32`` reduction and every tensor it makes in the
    default dtype is then a float32 tensor of the run, as it is in a real float16 run, where a
    float32 model's run makes those casts no-ops nobody can see. Not for float8 targets (scaled
    per tensor), under a policy (its own dtypes), layerwise or where float64 weights would not fit
    (memory), or on MPS (no float64)."""
    from castwise.numerics import layerwise as lw

    if t.float8 or policy is not None or layerwise or device.startswith("mps") or lw.too_large(model, 8):
        return False
    states = [x for x in (*model.parameters(), *model.buffers()) if x.is_floating_point()]
    given = [x for x in inputs.tensors() if x.is_floating_point()]
    return bool(states) and all(x.dtype == torch.float32 for x in (*states, *given))


def _origins(rec: RangeRecord, tmax: float) -> dict[tuple[str, str], list[tuple[str, float]]]:
    """(module, phase) -> [(op, output absmax)] for ops that pass ``tmax`` from inputs within it
    (a module that computes in float32 inside counts by the values that leave it: see RangeObserver)."""
    if not rec.op_out:
        return {}
    outs, ins = rec.op_out, rec.op_in
    found: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for (module, op, phase), o, i in zip(rec.op_keys, outs, ins, strict=True):
        # an input past the limit comes from a site upstream (or a parameter past it): that one is
        # reported there, and this op is judged as if it were fixed
        if o > tmax and i <= tmax:
            found.setdefault((module, phase), []).append((op, o))
    return found


def _state_sites(
    model: nn.Module, fixed: dict[int, torch.Tensor], tmax: float
) -> dict[tuple[str, str], list[tuple[str, float]]]:
    """(module, "forward") -> [("parameter NAME" | "buffer NAME", absmax)] for parameters and
    buffers already past ``tmax`` (finite): a copy of them in the target is Inf before any op runs.
    A tied tensor is a site of every module that holds it."""
    found: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for kind, named in (
            ("parameter", module.named_parameters(recurse=False)),
            ("buffer", module.named_buffers(recurse=False)),
        ):
            for name, t in named:
                amax = fixed.get(id(t))
                if amax is None:
                    continue
                a = float(amax)
                if tmax < a < math.inf:
                    qual = f"{module_name}.{name}" if module_name else name
                    found.setdefault((module_name, "forward"), []).append((f"{kind} {qual}", a))
    return found


def _overflow_findings(origins: dict[tuple[str, str], list[tuple[str, float]]], t: Target, mode: str) -> list[Finding]:
    findings = []
    for (module, phase), ops in origins.items():
        absmax = max(a for _, a in ops)
        margin = math.log2(absmax / t.max)
        names = sorted({op for op, _ in ops})
        held = [n for n in names if n.startswith(("parameter ", "buffer "))]
        if held:
            findings.append(_state_finding(module, held, absmax, margin, t, mode))
            continue
        if phase == "forward":
            fix = (
                f"Keep {where(module)} in float32 with a saturating cast back: `keep[{module or '*'}]=f32` in "
                f"the castwise policy; or keep it in bfloat16."
            )
        else:
            fix = (
                "Gradients overflow here: loss scaling (GradScaler) lowers the scale and skips the step; "
                f"or keep {where(module)} in float32 (`keep[{module or '*'}]=f32`), or train in bfloat16."
            )
        findings.append(
            Finding(
                code="CW310",
                module=module,
                op=names[0],
                modes=(as_mode(mode),),
                fix=fix,
                message=(
                    f"{', '.join(names)} in {where(module)} makes magnitudes up to {absmax:.4g} in {phase} from "
                    f"inputs within {t.name}'s range: 2^{margin:.2f} past its largest {t.max:.6g}, so {t.name} "
                    f"would make Inf here ({len(ops)} op call(s))."
                ),
                details=(
                    ("phase", phase),
                    ("target", t.name),
                    ("absmax", absmax),
                    ("margin_pow2", margin),
                    ("limit", t.max),
                    ("ops", names),
                ),
            )
        )
    return findings


def _state_finding(module: str, held: list[str], absmax: float, margin: float, t: Target, mode: str) -> Finding:
    return Finding(
        code="CW310",
        module=module,
        modes=(as_mode(mode),),
        fix=(
            f"Keep {where(module)} in float32 (`keep[{module or '*'}]=f32`: its weights stay float32), or bring "
            f"the values back into {t.name}'s range (a weight this large is usually a bug: a wrong init or scale)."
        ),
        message=(
            f"{', '.join(held)} of {where(module)} already holds magnitudes up to {absmax:.4g}: 2^{margin:.2f} past "
            f"{t.name}'s largest {t.max:.6g}, so a {t.name} copy of it is Inf before any op runs."
        ),
        details=(
            ("phase", "forward"),
            ("target", t.name),
            ("absmax", absmax),
            ("margin_pow2", margin),
            ("limit", t.max),
            ("tensors", [h.split(" ", 1)[1] for h in held]),
        ),
    )


def _module_stats(
    rec: RangeRecord, t: Target, origins: dict[tuple[str, str], list[tuple[str, float]]], mode: str
) -> tuple[dict[str, Any], list[Finding]]:
    stats: dict[str, Any] = {}
    findings: list[Finding] = []
    for (module, phase), mr in rec.modules.items():
        hist = mr.hist.tolist()
        absmax = float(mr.absmax)
        share, lowest = _flush_share(hist, t.flush_log2)
        entry: dict[str, Any] = {
            "absmax": absmax,
            "min_nonzero_pow2": None if math.isnan(lowest) else lowest,
            "flush_share": share,
            "ops": mr.ops,
            "overflow_ops": len(origins.get((module, phase), [])),
            "margin_pow2": math.log2(absmax / t.max) if absmax > 0 else None,
        }
        stats.setdefault(module, {})[phase] = entry
        if t.float8 or share <= THRESHOLD:
            continue
        what = "activations" if phase == "forward" else "gradients"
        message = (
            f"{100 * share:.1f}% of the non-zero {what} {where(module)} makes in {phase} are below half of "
            f"{t.name}'s smallest subnormal (2^{t.flush_log2 + 1:.0f}) and would flush to zero (smallest "
            f"about 2^{lowest:.0f})."
        )
        details: tuple[tuple[str, Any], ...] = (
            ("phase", phase),
            ("target", t.name),
            ("flush_share", share),
            ("min_nonzero_pow2", lowest),
        )
        fix = None
        if phase != "forward":  # flushed gradients: CW312, with the loss scale that lifts them
            k = _loss_scale(hist, t.flush_log2, absmax, t.max)
            fix = (
                f"Use loss scaling: a scale of 2^{k} lifts the flushed gradients into {t.name}'s range "
                "(torch.amp.GradScaler finds it dynamically); or train in bfloat16."
            )
            details += (("loss_scale_pow2", k),)
        code = "CW311" if phase == "forward" else "CW312"
        findings.append(
            Finding(code=code, module=module, modes=(as_mode(mode),), message=message, fix=fix, details=details)
        )
    return stats, findings


def _float8(model: nn.Module, rec: RangeRecord, t: Target, mode: str) -> tuple[dict[str, Any], list[Finding]]:
    recipe = t.recipe or Float8Recipe()
    leave: list[str] = []
    findings: list[Finding] = []
    per: dict[str, Any] = {}
    filtered = convert.reasons(model, recipe, {})
    for name, layer in model.named_modules():
        if not isinstance(layer, nn.Linear):
            continue
        ops = rec.operands.get(name, {})
        operands = {k: (score.shares(v) if isinstance(v, dict) else v) for k, v in ops.items()}
        verdict = f8l.judge(
            recipe,
            layer.in_features,
            layer.out_features,
            operands,
            math.log2(t.max) - t.flush_log2,
            mode == "train",
            filtered.get(name, []),
        )
        reasons = verdict["reasons"]
        per[name] = {
            **verdict,
            "operands": {k: v for k, v in operands.items() if isinstance(v, dict) and k in f8l.OPERANDS},
            "tokens": ops.get("tokens"),
            "leave_out": bool(reasons),
        }
        if reasons:
            leave.append(name)
            findings.append(
                Finding(
                    code="CW313",
                    module=name,
                    modes=(as_mode(mode),),
                    details=(
                        ("target", t.name),
                        ("recipe", str(recipe)),
                        ("flush_share", verdict["flush_share"]),
                        ("reasons", reasons),
                    ),
                    message=f"Leave {where(name)} out of {t.name} ({recipe} scaling): " + "; ".join(reasons) + ".",
                )
            )
    policy = ",".join(f"keep[{n}]=bf16" for n in leave)
    summary = {
        "recipe": str(recipe),
        "layers": per,
        "leave_out": leave,
        "policy": policy,
        "module_filter_fn": f8l.filter_source(leave),
    }
    return summary, findings


def forecast(
    model: nn.Module,
    inputs: Any,
    *,
    target: str = "f16",
    policy: Any = None,
    mode: str = "train",
    device: str | None = None,
    layerwise: bool | None = None,
    weights: Any = None,
    verify: bool = True,
) -> Report:
    """Run ``model`` once on real tensors in its current precision (or under ``policy``) and report
    where ``target`` would overflow (any precision ``Policy.parse`` reads, forecast in its narrowest
    format: "16-mixed" and "bf16" their compute dtype, "fp8", "mxfp8" and "transformer-engine" their
    float8 forward format; a bare dtype name, "f16", "bfloat16", "float8_e4m3fn", names it) (the margin
    in powers of two) and the share of values it would flush to zero, per module, forward and
    backward. ``summary["numerics"]`` holds every module's ranges; for float8 targets
    ``summary["float8"]`` names the layers to leave out, judged by the target's recipe (its
    scaling and its GEMMs' shape rules: "fp8" tensorwise, "bf16-mixed,fp8=rowwise", "mxfp8"), as
    a castwise policy and as a torchao ``module_filter_fn``. The model, its gradients and the
    random state are left as they were.

    ``layerwise``: run the model's repeated blocks one at a time (``castwise.numerics.layerwise``),
    each materialised only while it runs when it is on the meta device, from ``weights`` (a
    ``.safetensors`` file or a state dict; None: its own deterministic initialisation). None
    (default): layerwise when the model is on the meta device or its weights do not fit this
    machine. ``summary["numerics"]["layerwise"]`` says how it ran.

    ``verify``: the float32 islands the forward overflow findings suggest are re-run for real in
    the target (``locate_nonfinite`` under the target with them): each such fix says "Verified",
    "Not verified alone" with the smallest set the run ends finite with, or "Not verified".
    """
    t = parse_target(target)
    from castwise.numerics import layerwise as lw

    meta = on_meta(model) if isinstance(model, nn.Module) else False
    request = _run.check_args("forecast", model, inputs, policy, device, mode, meta_ok=layerwise is not False)
    pol, dev = request.policy, request.torch_device
    if layerwise is None:
        layerwise = meta or lw.too_large(model)
    if layerwise and not lw.blocks_of(model):
        why = "layerwise=True" if not meta else "on the meta device, it runs layerwise"
        raise AuditError(
            f"{type(model).__name__} ({why}) has no repeated blocks (a ModuleList of two or more modules of one "
            "class) to run one at a time; materialise it and pass layerwise=False"
        )
    if meta and pol is not None:
        raise AuditError(
            "policy= with a model on the meta device is not supported: forecast would copy it to apply the policy; "
            "run it in the precision to forecast from (its own dtypes), or materialise it first"
        )
    plan = lw.Plan(layerwise, weights)
    report = _run.reported(
        request, "forecast", lambda m: _forecast(m, request.inputs, t, pol, mode, dev, plan), copy_ok=not meta
    )
    if verify and not meta and not layerwise and not t.float8:
        return _verified(report, request, _base_policy(target, t))
    return report


def _base_policy(target: Any, t: Target) -> str:
    """The precision forecast's islands are verified under: the target when it names one
    ("16-mixed"), else the model cast whole to the format (a bare "f16": 16-true)."""
    key = str(target).strip()
    if canonical(key) in FORMATS:
        return "16-true" if t.dtype == torch.float16 else "bf16-true"
    return key


def _verified(report: Report, request: RunRequest, base: str) -> Report:
    """The forward overflow findings' islands (``keep[module]=f32``, all of them: forecast names
    every site) re-run under ``base`` by ``locate``: verified when the run ends finite; else the
    module of the next op that makes NaN/Inf is added, one at a time (the smallest set this greedy
    search finds), as ``locate`` does for its own. Said in each finding's fix."""
    at = [
        i
        for i, f in enumerate(report.findings)
        if f.code == "CW310" and f.module and dict(f.details).get("phase") == "forward"
    ]
    if not at:
        return report
    ours = list(dict.fromkeys(str(report.findings[i].module) for i in at))
    islands, finite = finite_with(request, base, ours, MOST_ISLANDS)
    keep = keeps(islands)
    if finite and islands == ours:
        note = f" Verified: a real {base} run with `{keep}` ends finite."
    elif finite:
        note = (
            f" Not verified alone: with forecast's island(s) a real {base} run still makes NaN/Inf in "
            f"{', '.join(islands[len(ours) :])}; with `{keep}` (the smallest set found, one producer at a "
            "time) it ends finite."
        )
    else:
        note = (
            f" Not verified: a real {base} run with `{keep}` still makes NaN/Inf; no set of up to {MOST_ISLANDS} "
            "more float32 islands made it finite (`castwise numerics --locate` names the op)."
        )
    for i in at:
        f = report.findings[i]
        report.findings[i] = replace(
            f, fix=(f.fix or "") + note, details=(*f.details, ("verified_islands", islands if finite else None))
        )
    return report


def _forecast(
    model: nn.Module, inputs: Inputs, t: Target, policy: Any, mode: str, device: str, plan: Any
) -> tuple[Report, BaseException | None]:
    from castwise.numerics import layerwise as lw

    inputs = inputs.real(device)
    with torch.no_grad():
        fixed = {
            id(x): x.detach().abs().float().amax()
            for x in (*model.parameters(), *model.buffers())
            if x.is_floating_point() and x.numel() and x.device.type != "meta"
        }
    scaled = (name_of(t.dtype), t.flush_log2) if t.float8 else None
    recipe = (t.recipe or Float8Recipe()) if t.float8 else None
    gemm = None if recipe is None else (f8l.SCORE[recipe.scaling], recipe.forward_dtype, recipe.gradient_dtype)
    error: BaseException | None = None
    if stand_in(model, inputs, t, policy, plan.layerwise, device):
        # the model's own casts are the target run's: no list of modules assumed to compute wide
        observer = RangeObserver(fixed, scaled, frozenset(), gemm, frozenset({STAND_IN, t.dtype}))
        wide_inputs = inputs.map(lambda x: x.to(STAND_IN) if x.dtype == torch.float32 else x)
        with _run.recast(model, lambda d: d == torch.float32, STAND_IN):
            error = _run.traced(model, _run.Capture(model), wide_inputs, mode, device, [observer]).error
        how = None
    if error is not None or not stand_in(model, inputs, t, policy, plan.layerwise, device):
        # float64 unsupported somewhere (or not a float32 model): the run in its own precision
        wide = frozenset(name for name, m in model.named_modules() if computes_in_float32(m))
        observer = RangeObserver(fixed, scaled, wide, gemm)
        if plan.layerwise:
            error, how = lw.run(model, inputs, mode, device, observer, plan.weights)
        else:
            error, how = _run.traced(model, _run.Capture(model), inputs, mode, device, [observer]).error, None
    rec = observer.rec
    # per-tensor float8 scaling does not overflow
    origins = {} if t.float8 else {**_origins(rec, t.max), **_state_sites(model, fixed, t.max)}
    findings = _overflow_findings(origins, t, mode)
    stats, more = _module_stats(rec, t, origins, mode)
    findings += more
    summary: dict[str, Any] = {"numerics": {"target": t.name, "modules": stats}}
    if t.float8:
        f8, f8_findings = _float8(model, rec, t, mode)
        findings += f8_findings
        summary["float8"] = f8
    if how is not None:
        summary["numerics"]["layerwise"] = how
    if error is not None:
        summary["numerics"]["error"] = f"{type(error).__name__}: {error}"
    report = Report(
        findings=findings,
        runs=[real_run(mode, device, policy, "incomplete" if error is not None else "ok")],
        summary=summary,
        extra={"numerics": forecast_rows(stats, t.name)},
        title=f"castwise numerics --forecast {t.name} ({'layerwise, ' if how else ''}real tensors, device {device}, "
        f"policy "
        f"{policy if policy is not None else 'none'})",
    )
    return report, error
