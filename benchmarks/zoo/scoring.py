"""Scoring an audit against the real CPU run: the rules both zoo benchmarks share.

- A real failure: the real CPU run under the same policy (``castwise.apply`` on the model, or
  the model as it is when there is no policy) raises a dtype error, in train mode (forward and
  backward of a float32 sum of the first output) or in eval mode (``eval()`` under no_grad).
  A real run raising anything else (a shape error...) is ``other_error``: that mode is not scored.
- detected: the audit reports an error finding (any code but the CW90x "could not check"
  warnings) in a mode where the real run failed.
- false alarm: an error finding in a mode where the real run passed.
- origin right: the first such error finding's ``origin.module`` (or one of its
  ``culprit_modules``) equals the planted module or lies inside it.
- empty slot: a message, fix or origin text with an interpolation left empty (``receives , which``,
  ``````, ``()``, ``None``).
- incomplete: the audit says it could not check the whole model (a run with status
  ``incomplete`` or a CW902 finding); an incomplete audit whose report is ``ok`` is a violation.

``score`` is a pure function of the recorded outcomes, so the rules are tested on hand-built cases.
"""

from __future__ import annotations

import json
import re
import signal
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from castwise.stories import call, first_tensor  # the stories run models the same way

MODES = ("train", "eval")
NOT_CHECKED = ("CW901", "CW902")  # "could not check" warnings: never a detection
_DTYPE_TEXT = re.compile(
    r"dtype|scalar ?type|same type|type of value|bfloat16|BFloat16|float16|Half|Float|Double|mat1 and mat2|"
    r"primitive descriptor|not implemented for|(?:weight|bias) type \(",
)
# an interpolation left empty: " , ", "``", "()" (not a call like `.to()`), "[]", "None", "meets . Real",
# "meets  weights"
# (two spaces before "#" are PEP 8's inline comment in a quoted code line, not an empty slot)
_EMPTY_SLOT = re.compile(r"\s,|``|''|(?<![\w.])\(\s*\)|\[\s*\]|\{\s*\}|\bNone\b|(?<=\S) {2,}(?=[^\s#])|\s\.(?:\s|$)")


@dataclass(frozen=True)
class RealOutcome:
    status: str  # ok, dtype_error, other_error
    message: str = ""


@dataclass(frozen=True)
class FindingView:
    code: str
    level: str
    modes: tuple[str, ...]
    module: str | None
    origin_module: str | None
    culprits: tuple[str, ...]
    message: str
    fix: str
    origin_text: str
    hook: str | None = None  # the user hook a CW115 finding names
    code_fix: str = ""  # "file:line: new line", where the finding has a code change
    code_fix_verified: bool = False  # castwise's re-audit with the change simulated found no error


@dataclass(frozen=True)
class AuditOutcome:
    status: str  # done, crash, timeout
    ok: bool = True
    incomplete: bool = False
    findings: tuple[FindingView, ...] = ()
    suggested_policy: str | None = None
    message: str = ""
    seconds: float = 0.0
    # a torch.compile'd model's audit: graphs Dynamo compiled during it (None: not compiled), and
    # whether any name in the report still says `_orig_mod` (the compile wrapper, never the user's)
    compiled_graphs: int | None = None
    orig_mod_named: bool = False


@dataclass(frozen=True)
class Score:
    real: dict[str, str]
    real_failed: bool
    detected: bool
    missed: bool
    false_alarm_modes: tuple[str, ...]
    origin_right: bool | None  # None: nothing detected to check
    origin_seen: str | None
    empty_slots: tuple[str, ...]
    crash: bool
    incomplete: bool
    incomplete_ok: bool  # an incomplete audit reported ok: never allowed
    extra: dict[str, Any] = field(default_factory=dict)


# -- the real run ---------------------------------------------------------------------------------


def is_dtype_error(exc: BaseException) -> bool:
    # torch.compile's own exceptions wrap the error it met (Dynamo's "RuntimeError when making
    # fake tensor call" quotes the node's fake tensors, dtypes and all): the wrapped one is judged
    root, seen = exc, {id(exc)}
    while type(root).__module__.startswith("torch._dynamo"):
        nxt = root.__cause__ or root.__context__
        if nxt is None or id(nxt) in seen:
            break
        root = nxt
        seen.add(id(nxt))
    return isinstance(root, (RuntimeError, TypeError, ValueError, NotImplementedError)) and bool(
        _DTYPE_TEXT.search(str(root))
    )


def run_mode(model: nn.Module, inputs: Any, mode: str) -> None:
    """One run as users run it: train = forward + backward of a float32 sum; eval = no_grad."""
    if mode == "eval":
        model.eval()
        with torch.no_grad():
            call(model, inputs)
        return
    model.train()
    t = first_tensor(call(model, inputs))
    if t is not None and t.requires_grad:
        t.float().sum().backward()  # type: ignore[no-untyped-call]  # f32 loss: the fault is upstream


def real_run(model: nn.Module, inputs: Any, policy: str | None, mode: str) -> RealOutcome:
    """The model run for real on CPU under ``policy`` (applied with castwise.apply)."""
    import castwise

    try:
        if policy is not None:
            castwise.apply(model, policy)
        run_mode(model, inputs, mode)
    except Exception as exc:
        status = "dtype_error" if is_dtype_error(exc) else "other_error"
        return RealOutcome(status, f"{type(exc).__name__}: {first_line(exc)}")
    return RealOutcome("ok")


def real_compiled_run(model: nn.Module, inputs: Any, policy: str | None, mode: str) -> RealOutcome:
    """The policy applied to ``model``, then ``torch.compile`` (Inductor), and that program run as
    ``real_run`` runs it (Dynamo's caches reset first: each case compiles anew)."""
    import castwise

    torch._dynamo.reset()
    if policy is not None:
        try:
            castwise.apply(model, policy)
        except Exception as exc:
            return RealOutcome("other_error", f"apply: {type(exc).__name__}: {first_line(exc)}")
    return real_run(torch.compile(model), inputs, None, mode)  # type: ignore[arg-type]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


# -- the audit ------------------------------------------------------------------------------------


class Timeout(Exception):
    pass


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise Timeout after ``seconds`` (SIGALRM: the benchmark's own worker processes only)."""

    def handler(signum: int, frame: Any) -> None:
        raise Timeout(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def view(finding: Any) -> FindingView:
    details = dict(finding.details)
    origin = finding.origin
    return FindingView(
        code=finding.code,
        level=finding.level,
        modes=tuple(finding.modes),
        module=finding.module,
        origin_module=origin.module if origin is not None else None,
        culprits=tuple(details.get("culprit_modules", ())),
        message=finding.message,
        fix=finding.fix or "",
        origin_text=str(origin) if origin is not None else "",
        hook=details.get("hook"),
        code_fix=str(finding.code_fix) if finding.code_fix is not None else "",
        code_fix_verified=finding.code_fix is not None and finding.code_fix.verified,
    )


def audit_outcome(
    model: nn.Module,
    inputs: Any,
    policy: str | None,
    timeout: int = 120,
    device: str | None = None,
    compiled: bool = False,
) -> AuditOutcome:
    """The audit of ``model`` (both modes); ``device``: the target device to simulate ("cuda");
    ``compiled``: of ``torch.compile(model)``."""
    import castwise

    if compiled:
        model = torch.compile(model)  # type: ignore[assignment]
    start = time.perf_counter()
    try:
        with time_limit(timeout):
            report = castwise.audit(model, inputs, policy=policy, mode="both", device=device)
    except Timeout as exc:
        return AuditOutcome("timeout", message=str(exc), seconds=time.perf_counter() - start)
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"{type(exc).__name__}: {first_line(exc)} ({where.filename.rsplit('/', 1)[-1]}:{where.lineno})"
        return AuditOutcome("crash", message=text, seconds=time.perf_counter() - start)
    incomplete = any(r.status == "incomplete" for r in report.runs) or any(f.code == "CW902" for f in report.findings)
    return AuditOutcome(
        "done",
        ok=report.ok,
        incomplete=incomplete,
        findings=tuple(view(f) for f in report.sorted_findings()),
        suggested_policy=None if report.suggested_policy is None else str(report.suggested_policy),
        seconds=time.perf_counter() - start,
        compiled_graphs=sum(int(c.get("graphs", 0)) for c in report.summary["compiled"].values()) if compiled else None,
        orig_mod_named="_orig_mod" in json.dumps(report.to_dict(), default=str),
    )


# -- a code fix, applied to the real run ------------------------------------------------------------


def _cast_back(hook: Any) -> Any:
    """``hook`` with its result cast back to the dtype of what it was given (its last argument):
    the code change a verified CW115 code fix names (``return new.to(grad.dtype)``)."""

    def cast(*args: Any) -> Any:
        out = hook(*args)
        given = args[-1]
        if isinstance(out, torch.Tensor) and isinstance(given, torch.Tensor) and out.dtype != given.dtype:
            return out.to(given.dtype)  # the fix itself: the result in the dtype the hook was given
        return out

    cast.__name__ = getattr(hook, "__name__", "hook")
    return cast


def _hook_named(hook: Any, names: frozenset[str]) -> bool:
    return (getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None)) in names


@contextmanager
def hooks_cast_back(model: nn.Module, names: frozenset[str]) -> Iterator[None]:
    """Apply the hook code fix to a real model (a fresh build, thrown away after): every forward
    hook and gradient hook named in ``names`` returns its result in the dtype it was given, also
    gradient hooks registered on activations while the model runs. Written here, not taken from
    castwise, so the real run checks the change independently of the audit's own simulation."""
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if _hook_named(hook, names):
                module._forward_hooks[key] = _cast_back(hook)
        for p in module._parameters.values():
            table = getattr(p, "_backward_hooks", None) if p is not None else None
            for key, hook in list((table or {}).items()):
                if _hook_named(hook, names):
                    table[key] = _cast_back(hook)  # type: ignore[index]  # table is the hooks dict
    original: Any = torch.Tensor.register_hook  # torch leaves it untyped

    def register(t: torch.Tensor, hook: Any) -> Any:
        return original(t, _cast_back(hook) if _hook_named(hook, names) else hook)

    torch.Tensor.register_hook = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]


# -- the score ------------------------------------------------------------------------------------


def errors_in(audit: AuditOutcome, mode: str) -> list[FindingView]:
    return [
        f
        for f in audit.findings
        if f.level == "error" and f.code not in NOT_CHECKED and (not f.modes or mode in f.modes)
    ]


def inside(module: str | None, planted: str) -> bool:
    if module is None:
        return False
    return module == planted or (planted == "" or module.startswith(planted + "."))


def has_empty_slot(text: str) -> bool:
    text = text.replace("and  query.dtype", "and query.dtype")  # torch's own sdpa message has the double space
    return _EMPTY_SLOT.search(text) is not None


def still_empty(snippet: str) -> bool:
    """Whether a recorded empty-slot snippet (``CODE: ...context...``) still counts under the
    current rule (results saved by an older harness are re-checked when summarised)."""
    body = snippet.split(": ", 1)[-1].removeprefix("...").removesuffix("...")
    return body == "empty message" or has_empty_slot(body)


def empty_slots(audit: AuditOutcome) -> tuple[str, ...]:
    """Each interpolation left empty, with its context; an empty message counts, an absent fix
    or origin does not."""
    bad = []
    for f in audit.findings:
        if not f.message.strip():
            bad.append(f"{f.code}: empty message")
        for text in (f.message, f.fix, f.origin_text):
            for line in text.splitlines():
                if line.startswith((" ", "\t")) or not line.strip():
                    continue  # indented detail lines (tables, code) are not sentences
                for match in _EMPTY_SLOT.finditer(line.replace("and  query.dtype", "and query.dtype")):
                    bad.append(f"{f.code}: ...{line[max(0, match.start() - 50) : match.end() + 20]}...")
    return tuple(bad)


def score(real: dict[str, RealOutcome], audit: AuditOutcome, expected_origin: str | None) -> Score:
    failed = [m for m in MODES if m in real and real[m].status == "dtype_error"]
    passed = [m for m in MODES if m in real and real[m].status == "ok"]
    done = audit.status == "done"
    hits = [f for m in failed for f in errors_in(audit, m)] if done else []
    detected = bool(hits)
    origin_right: bool | None = None
    seen = None
    if detected and expected_origin is not None:
        first = hits[0]
        seen = first.origin_module
        origin_right = any(inside(m, expected_origin) for m in (first.origin_module, *first.culprits))
    return Score(
        real={m: r.status for m, r in real.items()},
        real_failed=bool(failed),
        detected=detected,
        missed=bool(failed) and not detected,
        false_alarm_modes=tuple(m for m in passed if done and errors_in(audit, m)),
        origin_right=origin_right,
        origin_seen=seen,
        empty_slots=empty_slots(audit) if done else (),
        crash=audit.status != "done",
        incomplete=audit.incomplete,
        incomplete_ok=audit.incomplete and audit.ok,
    )


# -- low-precision share of matmul/conv work --------------------------------------------------------


class DtypeFlops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Matmul/conv/attention FLOPs (torch's own flop formulas) by the dtype they ran in."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.by_dtype: dict[torch.dtype, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = self.registry.get(func._overloadpacket)
        if counter is not None:
            dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            if dtype is not None:
                self.by_dtype[dtype] += int(counter(*args, **kwargs, out_val=out))
        return out


def low_share(by_dtype: dict[torch.dtype, int], low: torch.dtype) -> float | None:
    total = sum(by_dtype.values())
    return None if total == 0 else by_dtype.get(low, 0) / total
