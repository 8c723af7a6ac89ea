"""``castwise.locate_nonfinite``: the first op that made a NaN/Inf, and whether precision caused it.

One run on real tensors under the tracer checks every op's output (a sum per op, no kept
activation) and stops looking at the first op whose output holds a NaN or Inf its inputs did
not: the producer, not a propagator. Its inputs' ranges and the dtype's limits are recorded on
the spot. The verdict: the same op on the same inputs in a wider dtype (float32, or float64 for
a float32 op); when that is still non-finite and the op ran in 16 bits, the whole run again in
float32 (an input that underflowed to zero upstream is only visible that way). Finite in the
wider dtype: precision-caused (overflow, underflow, cancellation); non-finite: a real bug.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from castwise._autocast import DEVICE_TYPES, autocast
from castwise._dtypes import low_dtypes, short_of
from castwise.numerics import _run
from castwise.numerics.advice import bug_fix, precision_fix
from castwise.numerics.observe import NonfiniteObserver, OpFinder, Producer, limits
from castwise.numerics.rows import locate_rows
from castwise.policy import Policy
from castwise.report import Finding, Report, Run
from castwise.rules.audit._text import where
from castwise.run import Inputs, RunRequest
from castwise.trace.events import RunStatus, as_mode

_LOW = low_dtypes()


def real_run(mode: str, device: str, policy: Any, status: RunStatus) -> Run:
    """The one real-tensor run a numerics report (locate, forecast) describes."""
    return Run(as_mode(mode), device, None if policy is None else str(policy), status)


def _rng() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _wide_rerun(
    model: nn.Module, wrapper: _run.Capture, inputs: Inputs, mode: str, device: str, p: Producer
) -> bool | None:
    """The whole run again in float32, autocast off: is the producer's op finite there? None: the
    rerun did not run that op (another code path in float32) and made nothing non-finite either
    way it is judged by whether float32 made any NaN/Inf at all."""
    finder = OpFinder(p.module, p.op, p.phase, p.index)
    watcher = NonfiniteObserver()
    for param in model.parameters():
        param.grad = None  # the first run's gradients have the narrow dtype
    with contextlib.ExitStack() as stack, _run.widened(model):
        for d in DEVICE_TYPES:
            stack.enter_context(autocast(d, None, enabled=False))
        result = _run.traced(model, wrapper, inputs.widen(), mode, device, [watcher, finder])
    if finder.finite is not None:
        return finder.finite
    return watcher.best is None and not result.final_nonfinite


def _verdict(p: Producer, wide: bool | None) -> tuple[str, str]:
    """("precision" | "bug", the cause in words)."""
    lim = limits(p.out_dtype)
    if p.rerun_finite:
        if p.rerun_absmax is not None and p.rerun_absmax > lim["max"]:
            return "precision", (
                f"overflow: the result's magnitude reaches {p.rerun_absmax:.4g}, past "
                f"{lim['dtype']}'s largest {lim['max']:.6g}"
            )
        return "precision", (f"overflow inside the op: its result fits {lim['dtype']} but an intermediate does not")
    if p.out_dtype not in _LOW:
        return "bug", (f"{lim['dtype']} itself makes it: no training dtype is wider, the computation has to change")
    if wide:
        return "precision", (
            "underflow or cancellation upstream: in float32 the same computation stays finite "
            f"(an input that is exactly zero or rounded in {lim['dtype']} is not)"
        )
    return "bug", "non-finite in a wider dtype too: the computation itself makes it, not the precision"


def _message(p: Producer, verdict: str, cause: str, absorbed: bool) -> str:
    what = {"nan": "NaN", "inf": "Inf", "nan+inf": "NaN and Inf"}[p.made]
    phase = f"backward ({p.node})" if p.phase == "backward" and p.node else p.phase
    ins = (
        ", ".join(
            f"{r['tensor']} absmax {r['absmax']:.4g}" + (f" min {r['min_nonzero']:.3g}" if r["min_nonzero"] else "")
            for r in p.inputs[:3]
        )
        or "no tensor inputs"
    )
    text = (
        f"{p.op} in {where(p.module)} made {what} in {phase} from inputs without it ({ins}); "
        f"{short_of(p.out_dtype)} holds up to {limits(p.out_dtype)['max']:.6g}. {cause}."
    )
    if absorbed:
        text += " The model's outputs and gradients end finite (a later op clamped or masked it)."
    return text


def finding_of(p: Producer, verdict: str, cause: str, absorbed: bool, mode: str) -> Finding:
    code = "CW301" if verdict == "precision" else "CW302"
    fix = precision_fix(p) if verdict == "precision" else bug_fix(p)
    details: tuple[tuple[str, Any], ...] = (
        ("phase", p.phase),
        ("verdict", verdict),
        ("cause", cause),
        ("made", p.made),
        ("source", p.source),
        ("autograd_node", p.node),
        ("inputs", p.inputs),
        ("output", p.output),
        ("nonfinite_scalars", p.scalars),
        ("limits", limits(p.out_dtype)),
        ("reaches_output", not absorbed),
    )
    return Finding(
        code=code,
        module=p.module,
        op=p.op,
        modes=(as_mode(mode),),
        message=_message(p, verdict, cause, absorbed),
        fix=fix,
        severity="warning" if absorbed else None,
        details=details,
    )


def _state_finding(bad: list[str], mode: str) -> Finding:
    listed = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    # the module holding the first bad parameter or buffer ("parameter a.b.weight" -> "a.b"); an
    # input's is the model's top level
    kind, _, name = bad[0].partition(" ")
    module = name.rpartition(".")[0] if kind in ("parameter", "buffer") else ""
    return Finding(
        code="CW303",
        module=module,
        modes=(as_mode(mode),),
        details=(("tensors", bad),),
        message=f"NaN/Inf before any op ran: {listed}. No op of the model made it.",
    )


def locate_in(request: RunRequest, fn: Callable[..., Any] | None = None, *, verify: bool = True) -> Report:
    """locate_nonfinite of a checked request; ``fn(model, *args, **kwargs)`` replaces the forward
    call (a training step's own loss). Global state is left as it was (castwise.auditor).
    ``verify``: re-run a suggested float32 island and say whether it makes the run finite."""
    policy, mode, device = request.policy, request.mode, request.torch_device
    report = _run.reported(
        request, "locate", lambda target: _locate(target, request.inputs, policy, mode, device, fn), audit=fn is None
    )
    return _verified(report, request, fn) if verify else report


# how many float32 islands the search adds, one producer at a time, before it gives up
MOST_ISLANDS = 4


def keeps(islands: list[str]) -> str:
    return ",".join(f"keep[{m}]=f32" for m in islands)


def finite_with(
    request: RunRequest, base: str, islands: list[str], more: int, fn: Callable[..., Any] | None = None
) -> tuple[list[str], bool]:
    """``islands`` (``keep[module]=f32``) added to ``base`` and the run re-done for real; while it
    still makes NaN/Inf, the module of the op that makes it is added, one at a time, up to ``more``
    of them: (the islands, whether the run ended finite)."""
    islands = list(islands)
    most = len(islands) + more
    while True:
        again = locate_in(request.under(Policy.parse(f"{base},{keeps(islands)}")), fn, verify=False)
        finite = not again.summary["numerics"]["final_nonfinite"] and not again.findings
        nxt = next((f.module for f in again.findings if f.code == "CW301"), None)
        if finite or nxt is None or nxt in islands or len(islands) >= most:
            return islands, finite
        islands.append(nxt)


def _verified(report: Report, request: RunRequest, fn: Callable[..., Any] | None) -> Report:
    """The suggested ``keep[module]=f32`` of a forward precision finding (CW301), re-run: verified
    when the run ends finite; else the next producer's module is added, one at a time, until the
    run is finite (the smallest set this greedy search finds) or it gives up. Said in the fix."""
    at = next((i for i, f in enumerate(report.findings) if f.code == "CW301"), None)
    if at is None or request.policy is None:
        return report  # no island suggested, or no policy to add one to (the model as it is)
    first = report.findings[at]
    if first.module is None or first.module == "" or dict(first.details).get("phase") != "forward":
        return report
    islands, finite = finite_with(request, str(request.policy), [first.module], MOST_ISLANDS - 1, fn)
    keep = keeps(islands)
    if finite and len(islands) == 1:
        note = f" Verified: re-run with `{keep}`, the run ends finite."
    elif finite:
        note = (
            f" Not verified alone: with `keep[{first.module}]=f32` the run still makes NaN/Inf further on; "
            f"re-run with `{keep}` (the smallest set found, one producer at a time), it ends finite."
        )
    else:
        note = (
            f" Not verified: re-run with `{keep}` the run still makes NaN/Inf; no set of up to {MOST_ISLANDS} "
            "float32 islands made it finite: look at the code of these modules (a bug, or a scale that overflows "
            "float32's own range)."
        )
    report.findings[at] = dataclasses.replace(
        first, fix=(first.fix or "") + note, details=(*first.details, ("verified_islands", islands if finite else None))
    )
    return report


def _locate(
    model: nn.Module, inputs: Inputs, policy: Any, mode: str, device: str, fn: Callable[..., Any] | None
) -> tuple[Report, BaseException | None]:
    inputs = inputs.real(device)
    findings: list[Finding] = []
    bad = _run.nonfinite_state(model, inputs)
    rng = _rng()
    observer = NonfiniteObserver()
    wrapper = _run.Capture(model, fn)
    result = _run.traced(model, wrapper, inputs, mode, device, [observer])
    p = observer.best
    numerics: dict[str, Any] = {
        "ops_checked": observer.ops_checked,
        "final_nonfinite": result.final_nonfinite,
        "modules": {},
    }
    if bad:
        findings.append(_state_finding(bad, mode))
    elif p is not None:
        wide: bool | None = None
        if not p.rerun_finite and p.out_dtype in _LOW:
            _set_rng(rng)
            wide = _wide_rerun(model, wrapper, inputs, mode, device, p)
        verdict, cause = _verdict(p, wide)
        findings.append(finding_of(p, verdict, cause, not result.final_nonfinite, mode))
        numerics["modules"][p.module] = {
            "phase": p.phase,
            "op": p.op,
            "verdict": verdict,
            "inputs": p.inputs,
            "output": p.output,
            "limits": limits(p.out_dtype),
        }
    elif result.final_nonfinite:
        findings.append(
            Finding(
                code="CW304",
                module="",
                modes=(as_mode(mode),),
                message=(
                    "The outputs or gradients hold NaN/Inf but no traced op made it from finite inputs (it came "
                    "from outside the model's ops: a hook, an optimizer, a custom kernel the tracer cannot see)."
                ),
            )
        )
    if result.error is not None:
        numerics["error"] = f"{type(result.error).__name__}: {result.error}"
    failed = any(f.level == "error" for f in findings)
    status: RunStatus = "error" if failed else "incomplete" if result.error is not None else "ok"
    report = Report(
        findings=findings,
        runs=[real_run(mode, device, policy, status)],
        summary={"numerics": numerics},
        extra={"numerics": locate_rows(numerics["modules"])},
        title=f"castwise numerics --locate (real tensors, device {device}, policy "
        f"{policy if policy is not None else 'none'})",
    )
    return report, result.error


def locate_nonfinite(
    model: nn.Module, inputs: Any, *, policy: Any = None, mode: str = "train", device: str | None = None
) -> Report:
    """Run ``model`` on ``inputs`` on real tensors (forward, and backward in train mode) and
    report the first op, in execution order, that made a NaN/Inf from inputs without one.

    The finding (CW301 precision-caused, CW302 a real bug; CW303 NaN/Inf already in the weights
    or inputs; CW304 non-finite outputs no traced op made) names the module, the op, the user's
    ``file:line``, the inputs' ranges, the dtype's limits and the fix. ``policy``: run under a
    castwise policy (on a copy); None: the model as it is, under the caller's autocast if any.
    ``mode``: "train" or "eval". The model, its gradients, buffers and the random state are left
    as they were.
    """
    return locate_in(_run.check_args("locate_nonfinite", model, inputs, policy, device, mode))
