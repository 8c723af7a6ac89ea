"""``castwise.explain``: from an error already raised (or a silent precision problem described
in words) to its root cause, locus and fix (torch-free).

The text (a message, a traceback, a log with colours, rank prefixes and progress bars around it)
is normalised (``_reading``) and read into named evidence (``_features``): the message's wording
as a structured signal (which op refused which dtypes, on which sides), the traceback's frames
(libraries, modules, functions) and typed clues in the words. A multinomial logistic regression
fitted on real reports (``_model``, ``model.json``, re-fitted by ``benchmarks/fit_explain.py``)
turns the evidence into a calibrated probability per root cause. Every answer lists the evidence
that decided it; below the unsure threshold it says so, shows the top three and names what
would settle it.
"""

from __future__ import annotations

import re
import textwrap
import traceback
from dataclasses import dataclass, field
from typing import Any

from castwise._dtypes import short
from castwise._wrap import wrap
from castwise.categories import CATEGORIES
from castwise.diagnosis._advice import CAUSES, FAMILY_CAUSES, FIXES
from castwise.diagnosis._features import Evidence, extract
from castwise.diagnosis._frames import Frame, locus_frame, parse_frames
from castwise.diagnosis._model import Model
from castwise.diagnosis._model import load as load_model
from castwise.diagnosis._patterns import DTYPE_MENTION, Signal, read_signals
from castwise.diagnosis._reading import normalise, raising_block

WIDTH = 100
_MAX_CANDIDATES = 5
HIGH = 0.8  # at or above: an answer to act on (docs/explain.md reports how often these were right)


@dataclass(frozen=True)
class Locus:
    """Where the error shows in the text: the frame at fault (innermost non-plumbing frame)."""

    file: str | None
    line: int | None
    function: str | None
    library: str | None
    code: str | None = None
    module: str | None = None  # a module path when the text names one

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "library": self.library,
            "code": self.code,
            "module": self.module,
        }

    def __str__(self) -> str:
        path = self.file or "?"
        if self.library and self.file:
            from castwise.diagnosis._frames import library_of

            path = library_of(self.file)[1]
        where = path + (f":{self.line}" if self.line is not None else "")
        parts = [where]
        if self.function:
            parts.append(f"in {self.function}")
        if self.library:
            parts.append(f"[{self.library}]")
        if self.module:
            parts.append(f"module `{self.module}`")
        return " ".join(parts)


@dataclass(frozen=True)
class Candidate:
    category: str
    score: float  # probability-like, the candidates' scores sum to at most 1
    title: str

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "score": round(self.score, 3), "title": self.title}


@dataclass(frozen=True)
class Explanation:
    """What ``explain`` concluded. ``category`` is None when the text holds no evidence."""

    category: str | None
    candidates: tuple[Candidate, ...]
    title: str
    cause: str
    fixes: tuple[str, ...]
    locus: Locus | None
    confidence: float  # 0..1, the best candidate's calibrated probability
    rule: str | None  # the closest castwise rule code
    error: str | None = None  # the error line as read ("RuntimeError: ...")
    signal: str | None = None  # the normalised wording ("matmul-dtype in matmul (mat1 f32 vs mat2 bf16)")
    dtypes: tuple[str, ...] = ()  # the dtypes the message names, canonical names
    evidence: tuple[str, ...] = ()  # the clues behind the best candidate, strongest first
    is_dtype_error: bool = False
    unsure: bool = False  # the confidence is below the model's threshold: see the candidates
    settle: tuple[str, ...] = ()  # when unsure: what evidence would tell the candidates apart
    frames: tuple[Frame, ...] = field(default=(), repr=False, compare=False)

    @property
    def level(self) -> str:
        if self.category is None:
            return "none"
        if self.confidence >= HIGH:
            return "high"
        if not self.unsure:
            return "medium"
        return "low"

    def to_dict(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "candidates": [c.to_dict() for c in self.candidates],
            "title": self.title,
            "cause": self.cause,
            "fixes": list(self.fixes),
            "locus": self.locus.to_dict() if self.locus else None,
            "confidence": round(self.confidence, 3),
            "confidence_level": self.level,
            "rule": self.rule,
            "error": self.error,
            "signal": self.signal,
            "dtypes": list(self.dtypes),
            "evidence": list(self.evidence),
            "is_dtype_error": self.is_dtype_error,
            "unsure": self.unsure,
            "settle": list(self.settle),
        }

    def __str__(self) -> str:
        return render(self)


# -- input ----------------------------------------------------------------------------------


def error_text(error: BaseException | str) -> str:
    """The text to read: a string as given; an exception formatted with its traceback, notes and
    chained causes, as Python would print it."""
    if isinstance(error, str):
        return error
    if isinstance(error, BaseException):
        try:
            return "".join(traceback.format_exception(type(error), error, error.__traceback__))
        except Exception:  # a broken __str__ must not stop the explanation
            return f"{type(error).__name__}: {error!r}"
    raise TypeError(f"explain() takes an exception or a string, not {type(error).__name__}")


_MODULE_NOTE = re.compile(r"castwise: raised in module `([^`]+)`")
_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(?P<type>[A-Z]\w*(?:Error|Exception))\s*:\s*(?P<msg>.+)$")


def _error_line(text: str, signals: list[Signal]) -> str | None:
    """The line that states the error: the last ``SomeError: ...`` line, else the first signal's."""
    found = None
    for line in text.splitlines():
        m = _ERROR_LINE.match(line)
        if m is not None:
            found = f"{m.group('type')}: {m.group('msg').strip()}"
    if found is None and signals:
        found = signals[0].text
    return found[:400] if found else None


_ANCHOR = re.compile(r"Traceback|Error\b|Exception\b|error:|^\s*File |\.py:\d+|dtype|scalar type", re.I)
_FOCUS_CHARS = 40_000
_FOCUS_AROUND = 40
_FOCUS_TAIL = 200


def _focus(text: str) -> str:
    """A long log reduced to what can hold evidence: the lines around errors and tracebacks and
    the tail. Keeps ``explain`` fast on megabyte logs; short texts are read whole."""
    if len(text) <= _FOCUS_CHARS:
        return text
    lines = text.splitlines()
    keep = set(range(max(0, len(lines) - _FOCUS_TAIL), len(lines)))
    for i, line in enumerate(lines):
        if _ANCHOR.search(line):
            keep.update(range(max(0, i - _FOCUS_AROUND), min(len(lines), i + _FOCUS_AROUND + 1)))
    # repeated lines (progress bars, per-step logs) say nothing new
    out: list[str] = []
    seen: set[str] = set()
    for i in sorted(keep):
        line = lines[i][:2000]
        if line in seen and not _ANCHOR.search(line):
            continue
        seen.add(line)
        out.append(line)
    return "\n".join(out[-4000:])


# -- reading and scoring ------------------------------------------------------------------

_GENERIC_FAMILIES = ("matmul-dtype", "scalar-type-arg", "scalar-type", "conv-dtype", "expected-got")
_NOT_PRECISION = {"int64", "int32", "int16", "bool"}
# features that say something about a cause (structural features alone do not make a diagnosis)
_INFORMATIVE = ("msg:", "frame:", "text:", "clue:", "ctx:", "silent&")


def _informative(x: dict[str, float]) -> bool:
    return any(k.startswith(_INFORMATIVE) and k not in ("msg:device-mismatch", "ctx:no adapter evidence") for k in x)


def _integer_clash(sig: Signal | None) -> bool:
    """An index or label tensor met a float one: a dtype error, but not a precision clash."""
    return sig is not None and sig.family in _GENERIC_FAMILIES and bool({sig.first, sig.second} & _NOT_PRECISION)


def _rule_for(category: str | None) -> str | None:
    if category is None:
        return None
    from castwise.rules import REGISTRY

    order = {"error": 0, "warning": 1, "info": 2}
    rules = sorted(
        (r for r in REGISTRY.values() if r.category == category), key=lambda r: (order.get(r.severity, 3), r.code)
    )
    return rules[0].code if rules else None


def _cause(category: str, sig: Signal | None) -> str:
    base = CAUSES[category]
    if sig is None:
        return base
    said = ""
    if sig.first and sig.second:
        a, b = short(sig.first), short(sig.second)
        op = sig.op or "the kernel"
        if sig.roles == ("expected", "found"):
            said = f"{op[0].upper()}{op[1:]} expected {a} and found {b}. "
        elif sig.roles[0]:
            said = f"{op[0].upper()}{op[1:]} received {sig.roles[0]} {a} and {sig.roles[1]} {b}. "
        else:
            said = f"{op[0].upper()}{op[1:]} received {a} and {b}. "
    elif sig.first and sig.op:
        said = f"{sig.op} was called with {short(sig.first)}. "
    return said + base


def _read(error: BaseException | str) -> tuple[str, str, list[Signal], Evidence]:
    raw = _focus(error_text(error))
    # castwise's own notes (an annotated error pasted back) are conclusions, not evidence
    text = normalise("\n".join(line for line in raw.splitlines() if not line.startswith("castwise:")))
    signals = read_signals(text)
    return raw, text, signals, extract(text, signals=signals)


# a single word is weak evidence: listed after the structured reasons, and only where it weighed
_WORD_PUSH = 0.3


def _decisive(pushes: list[tuple[float, str]], reasons: dict[str, str]) -> tuple[str, ...]:
    """What decided the answer, for the listing: the structured evidence first (the message, the
    frames, the clues), then at most two words that weighed on their own."""
    named = [reasons[n] for _, n in pushes if not n.startswith("word:")]
    words = [reasons[n] for p, n in pushes if n.startswith("word:") and p >= _WORD_PUSH][:2]
    return tuple(dict.fromkeys(named[:6] + words))[:6]


def read_evidence(error: BaseException | str) -> Evidence:
    """The evidence ``explain`` reads from ``error``: what the fitted model scores (the fitting
    script reads reports through this same function, so training and use never diverge)."""
    return _read(error)[3]


def explain(error: BaseException | str) -> Explanation:
    """Explain a mixed-precision dtype error or a silent precision problem: ``error`` is an
    exception, or the text of an error message, traceback, log or report. Returns the ranked root
    causes with a calibrated confidence, the evidence that decided them, the locus and the fixes."""
    raw, text, signals, evidence = _read(error)
    x = evidence.vector()
    model = load_model()
    has_dtype_words = bool(DTYPE_MENTION.search(text))
    dtype_signal = any(s.dtype_error for s in signals)
    # in a chain of exceptions the first block raised the error; the wrapper's frames are not the locus
    block = raising_block(text, lambda b: any(s.dtype_error for s in read_signals(b)))
    block_signals = read_signals(block) if block is not text else signals
    found = block_signals or signals
    sig: Signal | None = found[-1] if found else None
    # a wording that names its cause outright, outside the fitted categories: answered as written
    decided = FAMILY_CAUSES.get(sig.family) if sig is not None else None

    no_cause = (
        decided is not None
        or not _informative(x)
        or (sig is not None and sig.family == "device-mismatch" and not dtype_signal)
        or _integer_clash(sig)
    )
    category, candidates, confidence, unsure = _rank(model, x, no_cause=no_cause)
    locus, real_frames = _locate(raw, text, block, list(evidence.frames))

    settle: tuple[str, ...] = ()
    fixes: tuple[str, ...] = ()
    why: tuple[str, ...] = ()
    if decided is not None:
        title, cause, fixes, _ = decided
    elif category is None:
        title, cause = _no_cause(sig)
    else:
        title = CATEGORIES[category].title
        cause = _cause(category, sig)
        fixes = FIXES.get(category, ())
        runner = candidates[1].category if len(candidates) > 1 else None
        reasons = evidence.why()
        why = _decisive(model.contributions(x, category, runner), reasons)
        if unsure:
            settle = tuple(f"{c}: {hint}" for c, hint in model.settlers(x, [c.category for c in candidates[:3]]))

    dtypes = tuple(dict.fromkeys(d for s in signals for d in s.dtypes))
    return Explanation(
        category=category,
        candidates=candidates,
        title=title,
        cause=cause,
        fixes=fixes,
        locus=locus,
        confidence=confidence,
        rule=decided[3] if decided is not None else _rule_for(category),
        error=_error_line(block if block is not text else text, block_signals or signals),
        signal=sig.describe() if sig else None,
        dtypes=dtypes,
        evidence=why,
        is_dtype_error=decided is not None
        or (
            category is not None
            and (dtype_signal or (has_dtype_words and confidence >= 0.5 and evidence.has_error_line))
        ),
        unsure=unsure,
        settle=settle,
        frames=tuple(real_frames),
    )


def _rank(
    model: Model, x: dict[str, float], *, no_cause: bool
) -> tuple[str | None, tuple[Candidate, ...], float, bool]:
    """The answer, the candidates shown, the confidence and whether it is unsure; no answer at all
    when the evidence names no cause (``no_cause``)."""
    if no_cause:
        return None, (), 0.0, False
    probs = sorted(
        zip(model.categories, model.calibrated(model.probabilities(x)), strict=True), key=lambda t: (-t[1], t[0])
    )
    category, confidence = probs[0]
    unsure = confidence < model.unsure_below
    floor = max(0.03, confidence * 0.1)
    kept = [(c, p) for c, p in probs if p >= floor][:_MAX_CANDIDATES]
    if unsure:  # thin evidence: always show the runners-up
        kept = probs[: max(3, len(kept))]
    return category, tuple(Candidate(c, p, CATEGORIES[c].title) for c, p in kept), confidence, unsure


def _locate(raw: str, text: str, block: str, frames: list[Frame]) -> tuple[Locus | None, list[Frame]]:
    """The locus (in the raising block of a chain when there is one) and the traceback's real frames."""
    real_frames = [f for f in frames if f.file != "<listing>"]
    block_frames = parse_frames(block) if block is not text else real_frames
    lf = locus_frame(block_frames or real_frames)
    # a module path in the text: castwise.diagnose()'s own note, when an annotated error is pasted
    named = _MODULE_NOTE.search(raw)
    module = named.group(1) if named else None
    locus = Locus(lf.file, lf.line, lf.function, lf.library, lf.code, module) if lf is not None else None
    if locus is None and (frames or module):
        locus = Locus(None, None, None, None, frames[-1].code if frames else None, module)
    return locus, real_frames


def _no_cause(sig: Signal | None) -> tuple[str, str]:
    """Title and text when no mixed-precision cause is given: why not, and what to do instead."""
    if sig is not None and sig.family == "device-mismatch":
        title = "not a dtype error: one dtype on two devices"
        cause = (
            f"Both tensors are {short(sig.first or '?')}; the message names them by device type (CUDA vs "
            "CPU tensor). Move the input or the module to the same device (`x.to(next(model.parameters())"
            ".device)`)."
        )
    elif sig is not None and sig.dtype_error:
        title = "a dtype error, but no mixed-precision cause fits"
        names = " and ".join(short(d) for d in sig.dtypes) or "two dtypes"
        cause = (
            f"{sig.op or 'An op'} got {names}: not a clash between floating precisions (an integer index "
            "or label tensor, or a dtype castwise does not reason about). Cast the tensor to the dtype "
            "the op documents."
        )
    else:
        title = "no evidence of a mixed-precision dtype error"
        cause = (
            "Nothing in the text names a dtype mismatch, a precision setting or a library castwise "
            "knows. Paste the full traceback with the error message."
        )
    return title, cause


# -- rendering ------------------------------------------------------------------------------

_LABEL = 10


def _field(label: str, text: str, width: int = WIDTH) -> list[str]:
    # a policy or code span is never cut; pasted text with no code may be (it keeps the width)
    return wrap(" ".join(text.split()), width, f"  {label:<{_LABEL}}", " " * (2 + _LABEL), split_plain=True)


def _rule_and_fixes(e: Explanation, width: int, *, rule: bool = True, fixes: bool = True) -> list[str]:
    lines: list[str] = []
    if rule and e.rule:
        from castwise.rules import REGISTRY

        name = REGISTRY[e.rule].name if e.rule in REGISTRY else ""
        lines += _field("rule", f"{e.rule} {name} (`castwise rules {e.rule}` for the page)", width)
    for i, fix in enumerate(e.fixes if fixes else (), 1):
        lines += _field("fix" if i == 1 else "", f"{i}. {fix}", width)
    return lines


def render(e: Explanation, width: int = WIDTH) -> str:
    """The explanation as text for a terminal ``width`` columns wide (100 by default)."""
    if e.category is None:
        lines = [f"castwise explain: {e.title}"]
        if e.error:
            lines += _field("error", e.error, width)
        lines += _field("note", e.cause, width)
        return "\n".join(lines + _rule_and_fixes(e, width))
    if e.unsure:
        lines = [f"castwise explain: unsure; most likely {e.category}  (confidence {e.confidence:.2f})"]
    else:
        lines = [f"castwise explain: {e.category}  (confidence {e.level}, {e.confidence:.2f})"]
    lines += textwrap.wrap(e.title, width=width, initial_indent="  ", subsequent_indent="  ")
    lines += _rule_and_fixes(e, width, fixes=False)
    if e.error:
        lines += _field("error", e.error, width)
    if e.signal:
        lines += _field("read as", e.signal, width)
    if e.locus is not None:
        lines += _field("at", str(e.locus), width)
        if e.locus.code:
            lines += _field("", e.locus.code, width)
    lines += _field("cause", e.cause, width)
    lines += _rule_and_fixes(e, width, rule=False)
    for i, why in enumerate(e.evidence[:4]):
        lines += _field("evidence" if i == 0 else "", why, width)
    others = [c for c in e.candidates if c.category != e.category]
    if others:
        lines.append("")
        head = "other candidates" if not e.unsure else "not enough evidence to be sure; also possible"
        lines += textwrap.wrap(f"{head}:", width=width, initial_indent="  ")
        for c in others:
            lines += textwrap.wrap(
                f"{c.score:4.2f}  {c.category}: {c.title}",
                width=width,
                initial_indent="    ",
                subsequent_indent="          ",
            )
    if e.unsure:
        lines.append("")
        if e.settle:
            lines += textwrap.wrap("what would settle it:", width=width, initial_indent="  ")
            for hint in e.settle:
                lines += textwrap.wrap(hint, width=width, initial_indent="    ", subsequent_indent="      ")
        lines += _field(
            "to know",
            "run the failing step under castwise.diagnose() or `castwise audit`: they "
            "answer from the real dtype flow, not from the text.",
            width,
        )
    return "\n".join(lines)
