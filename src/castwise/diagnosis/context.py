"""``castwise.diagnose()``: dtype errors raised inside get notes naming the module, the origin of
the offending dtype, the root cause and the fix (PEP 678 ``add_note``).

Nothing happens while nothing fails: no hooks, no modes, no tracing. All the work waits until
``__exit__`` sees an exception, because the failing traceback still holds everything needed:
its frames whose ``self`` is an ``nn.Module`` give the module path (the outermost is the root
model, the innermost the failing layer), and the root frame holds the call's arguments, which
castwise's audit replays on fake tensors to find where the offending dtype came from.

The exception object is re-raised as it was (same type, same traceback); diagnose never raises
from its own failures.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from castwise._dtypes import short

if TYPE_CHECKING:
    from torch import nn

    from castwise.diagnosis.explain import Explanation
    from castwise.report import Finding, Report

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "__castwise_diagnosed__"
_PREFIX = "castwise:"
# module call plumbing: its frames hold the call's (args, kwargs) exactly as the caller passed them
_CALL_FRAMES = ("_wrapped_call_impl", "_call_impl")


class _Diagnose(contextlib.ContextDecorator):
    """The context manager (and decorator) ``diagnose()`` returns."""

    def __enter__(self) -> _Diagnose:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if exc is not None and isinstance(exc, Exception):
            with contextlib.suppress(Exception):  # never replace the user's error with our own
                annotate(exc)
        return False  # re-raise the original exception object, traceback untouched


@overload
def diagnose(func: F) -> F: ...
@overload
def diagnose(func: None = None) -> _Diagnose: ...


def diagnose(func: F | None = None) -> F | _Diagnose:
    """Explain dtype errors raised inside, as notes on the exception.

    Use it as ``with castwise.diagnose(): ...``, as ``@castwise.diagnose()`` or as
    ``@castwise.diagnose``. A dtype error gets notes: the module path where it was raised, where
    the offending dtype came from (found by replaying the failing model call on fake tensors),
    the root cause and the fix. Other exceptions pass untouched."""
    if func is not None:
        if not callable(func):
            raise TypeError(f"diagnose() takes no arguments or a function to wrap, not {type(func).__name__}")
        cm = _Diagnose()

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with cm:
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
    return _Diagnose()


# -- the work, done only when something failed ----------------------------------------------


def annotate(exc: BaseException) -> list[str]:
    """Add castwise's notes to ``exc`` if it is a dtype error; returns the notes added."""
    if getattr(exc, _MARK, False):  # an inner diagnose() already did it
        return []
    from castwise.diagnosis.explain import explain

    explanation = explain(exc)
    if not explanation.is_dtype_error:
        return []
    with contextlib.suppress(Exception):
        setattr(exc, _MARK, True)
    notes: list[str] = []
    site = _module_site(exc.__traceback__)
    report: Report | None = None
    replay_error: str | None = None
    policy: str | None = None
    if site is not None:
        notes.append(_where_note(site))
        report, replay_error, policy = _replay(site, explanation)
    finding = _best_finding(report, site.inner_name if site else None) if report is not None else None
    if finding is not None and finding.origin is not None:
        under = f" under policy {policy}" if policy else ""
        notes.append(
            f"{_PREFIX} the offending dtype came from {_origin_text(finding)} (found by replaying "
            f"the call on fake tensors{under}: {finding.code} {finding.rule.name})"
        )
    elif site is not None and replay_error is not None:
        notes.append(f"{_PREFIX} origin of the dtype not found: {replay_error}")
    notes.extend(_cause_notes(explanation, finding))
    for note in notes:
        _add_note(exc, note)
    return notes


def _add_note(exc: BaseException, note: str) -> None:
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:  # Python 3.10: PEP 678's attribute, printed by tools that know it
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            exc.__notes__ = notes  # type: ignore[attr-defined]
        notes.append(note)


class _Site:
    """Where in the model the error was raised, read from the traceback's frames."""

    def __init__(
        self, root: nn.Module, root_frames: list[FrameType], inner: nn.Module, inner_name: str, path: list[str]
    ) -> None:
        self.root = root
        self.root_frames = root_frames
        self.inner = inner
        self.inner_name = inner_name
        self.path = path  # the module names from the root to the innermost, as the frames show them


def _module_site(tb: TracebackType | None) -> _Site | None:
    torch = sys.modules.get("torch")
    if torch is None:  # no torch loaded: no module can be on the stack
        return None
    module_type = torch.nn.Module
    frames: list[tuple[FrameType, Any]] = []
    while tb is not None:
        frame = tb.tb_frame
        obj = frame.f_locals.get("self")
        if isinstance(obj, module_type):
            frames.append((frame, obj))
        tb = tb.tb_next
    if not frames:
        return None
    inner = frames[-1][1]
    # the root: the outermost module on the stack whose tree holds the innermost one
    seen: set[int] = set()
    for _, candidate in frames:
        if id(candidate) in seen:
            continue
        seen.add(id(candidate))
        names = {id(m): n for n, m in candidate.named_modules()}
        if id(inner) in names:
            root_frames = [f for f, m in frames if m is candidate]
            path: list[str] = []
            for _, m in frames:
                n = names.get(id(m))
                if n is not None and n not in path:
                    path.append(n)
            return _Site(candidate, root_frames, inner, names[id(inner)], path)
    return None


def _where_note(site: _Site) -> str:
    root_cls = type(site.root).__name__
    cls = type(site.inner).__name__
    if not site.inner_name:
        return f"{_PREFIX} raised in the model itself ({root_cls}.forward)"
    return f"{_PREFIX} raised in module `{site.inner_name}` ({cls}) of {root_cls}"


def _call_inputs(site: _Site) -> tuple[Any, ...] | dict[str, Any] | None:
    """The root call's arguments: the module-call frame's (args, kwargs) when the model was
    called as ``model(...)``, else the forward frame's parameters."""
    for frame in site.root_frames:
        if frame.f_code.co_name in _CALL_FRAMES:
            loc = frame.f_locals
            args, kwargs = loc.get("args"), loc.get("kwargs")
            if isinstance(args, tuple) and isinstance(kwargs, dict):
                if kwargs and not args:
                    return dict(kwargs)
                if not kwargs:
                    return args
                return _bind(site.root, args, kwargs)
    for frame in site.root_frames:
        if frame.f_code.co_name == "forward":
            return _from_forward_frame(site.root, frame)
    return None


def _bind(root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    try:
        bound = inspect.signature(root.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        param = inspect.signature(root.forward).parameters[name]
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            return None  # *args after keywords cannot be passed as a dict
        else:
            out[name] = value
    return out


def _from_forward_frame(root: nn.Module, frame: FrameType) -> dict[str, Any] | None:
    try:
        params = inspect.signature(root.forward).parameters
    except (TypeError, ValueError):
        return None
    loc = frame.f_locals
    out: dict[str, Any] = {}
    for name, param in params.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = loc.get(name)
            if isinstance(extra, dict):
                out.update(extra)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        elif name in loc:
            out[name] = loc[name]
    return out


def _mixed_policy(explanation: Explanation) -> str | None:
    """Autocast's state is gone by __exit__: guess it from the low dtype the message names."""
    if "bfloat16" in explanation.dtypes:
        return "bf16-mixed"
    if "float16" in explanation.dtypes:
        return "16-mixed"
    return None


def _replay(site: _Site, explanation: Explanation) -> tuple[Report | None, str | None, str | None]:
    """Audit the root call on fake tensors: as the model is, then under the mixed policy of the
    message's low dtype. Returns the report, why no origin was found, and the policy used."""
    try:
        from castwise.auditor import audit
    except ImportError:
        return None, "castwise's audit is not available", None
    inputs = _call_inputs(site)
    if inputs is None:
        return None, "the model call's arguments could not be read from the traceback", None
    mode = "train" if site.root.training else "eval"
    last_error: str | None = None
    report: Report | None = None
    mixed = _mixed_policy(explanation)
    fallback: tuple[Report, str | None] | None = None
    for policy in (None, mixed) if mixed else (None,):
        try:
            report = audit(site.root, inputs, policy=policy, mode=mode, fake=True)
        except Exception as err:  # the replay is best effort
            last_error = f"replay under policy {policy or 'none'} failed ({type(err).__name__}: {err})"
            continue
        if _best_finding(report, site.inner_name, related_only=True) is not None:
            return report, None, policy
        if fallback is None and _best_finding(report) is not None:
            fallback = (report, policy)  # an error elsewhere in the model: keep looking first
        last_error = f"the replay (policy {policy or 'none'}) did not reproduce the error"
    if fallback is not None:
        return fallback[0], None, fallback[1]
    return report, last_error, None


def _related(a: str | None, b: str) -> bool:
    if a is None:
        return False
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def _best_finding(report: Report | None, module: str | None = None, *, related_only: bool = False) -> Finding | None:
    """The error finding that explains the failure: at the failing module when one is, with an
    origin when one has it."""
    if report is None:
        return None
    errors = [f for f in report.findings if f.level == "error" and f.rule.category is not None]
    if module is not None:
        near = [f for f in errors if _related(f.module, module)]
        if near or related_only:
            errors = near
    errors.sort(key=lambda f: (f.module != module, f.origin is None))
    return errors[0] if errors else None


def _origin_text(finding: Finding) -> str:
    origin = finding.origin
    if origin is None:
        return "(unknown)"
    if origin.module:
        text = f"`{origin.module}`"
    elif origin.module == "":
        text = "the model's inputs"
    else:
        text = "(unknown module)"
    if origin.op:
        text += f" (op {origin.op})"
    if origin.tensor:
        text += f", tensor {origin.tensor}"
    return text


def _cause_notes(explanation: Explanation, finding: Finding | None) -> list[str]:
    from castwise.categories import CATEGORIES

    notes: list[str] = []
    category = finding.rule.category if finding is not None else explanation.category
    if category is None:
        return notes
    # a wording that names its own cause (outside the fitted categories) says it, not the category's title
    head = f"{category}: {CATEGORIES[category].title}" if explanation.category or not explanation.rule else None
    code = finding.code if finding is not None else explanation.rule
    rule = f" ({code}; `castwise rules {code}`)" if code else ""
    dtypes = ", ".join(short(d) for d in explanation.dtypes)
    seen = f" [{dtypes}]" if dtypes else ""
    notes.append(f"{_PREFIX} cause: {head or explanation.title.removeprefix('a dtype error: ')}{rule}{seen}")
    fix = (
        (finding.fix or finding.rule.fix)
        if finding is not None
        else (explanation.fixes[0] if explanation.fixes else None)
    )
    if fix:
        notes.append(f"{_PREFIX} fix: {' '.join(fix.split())}")
    return notes
