"""``castwise.explain``: from an error already raised to its root cause, locus and fix (torch-free).

The text (a message, a traceback, a log with noise around it) is read into evidence of three
kinds (see ``_evidence``): the message's wording normalised into a signal (which op refused
which dtypes), the traceback's frames (the libraries and functions it went through) and words
in the text. Every clue adds weight to some of the 19 root causes; all causes are scored and
ranked. When the evidence is thin, the explanation says so: low confidence, several candidates.
"""

from __future__ import annotations

import math
import re
import textwrap
import traceback
from dataclasses import dataclass, field
from typing import Any

from castwise._dtypes import short
from castwise.categories import CATEGORIES
from castwise.diagnosis import _evidence as ev
from castwise.diagnosis._advice import CAUSES, FIXES
from castwise.diagnosis._frames import (
    Frame,
    evidence_text,
    is_plumbing,
    locus_frame,
    numbered_code,
    parse_frames,
)
from castwise.diagnosis._patterns import DTYPE_MENTION, Signal, read_signals

WIDTH = 100
_TEMPERATURE = 2.0  # softmax temperature over scores: a lead of ~4 points is ~90% confidence
_MIN_SCORE = 1.5  # below this, nothing points at any cause: category None
_MAX_CANDIDATES = 5


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
        return {"file": self.file, "line": self.line, "function": self.function,
                "library": self.library, "code": self.code, "module": self.module}

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
    confidence: float  # 0..1, the best candidate's share
    rule: str | None  # the closest castwise rule code
    error: str | None = None  # the error line as read ("RuntimeError: ...")
    signal: str | None = None  # the normalised wording ("matmul-dtype in matmul (mat1 f32 vs mat2 bf16)")
    dtypes: tuple[str, ...] = ()  # the dtypes the message names, canonical names
    evidence: tuple[str, ...] = ()  # the clues behind the best candidate, strongest first
    is_dtype_error: bool = False
    frames: tuple[Frame, ...] = field(default=(), repr=False, compare=False)

    @property
    def level(self) -> str:
        if self.category is None:
            return "none"
        if self.confidence >= 0.6:
            return "high"
        if self.confidence >= 0.35:
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


# -- scoring --------------------------------------------------------------------------------


@dataclass
class _Tally:
    scores: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    reasons: dict[str, list[tuple[float, str]]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})

    def add(self, weights: ev.Weights, reason: str, scale: float = 1.0) -> None:
        for cat, w in weights.items():
            self.scores[cat] += w * scale
            if w > 0:
                self.reasons[cat].append((w * scale, reason))


def _frame_key(f: Frame) -> str:
    return f"{f.path} {f.function or ''} {f.code or ''}"


_MODEL_LIBS = ("transformers", "diffusers", "timm", "open_clip", "torchvision", "sentence_transformers")
_CODE_LINE = re.compile(r"^\s*(return\b|[\w.\[\]]+(\s*,\s*[\w.]+)*\s*=\s*[\w.]+\(|[\w.]+\()")
_NORM_WORD = re.compile(r"layer ?norm|rms ?norm|\b[qk]_?norm|\bnorm\d?\b|\bln_?\w*\(", re.I)
_AUTOCAST = re.compile(r"autocast|\bamp\b|torch\.cuda\.amp|mixed[_ ]precision|-mixed\b|precision=16", re.I)


def _context(text: str, signals: list[Signal], frames: list[Frame]) -> ev.Context:
    inner = [f for f in frames if not f.native][-2:]
    codes = [f"{f.path} {f.function or ''} {f.code or ''}" for f in inner]
    if not codes:
        codes = numbered_code(text)[-2:] or [ln for ln in text.splitlines() if _CODE_LINE.match(ln)][-2:]
    # the frame that called the refusing op (not the thin-layer-skipping locus)
    lf = next((f for f in reversed(frames) if not is_plumbing(f)), None)
    library_model = lf is not None and lf.library in _MODEL_LIBS and (
        "/models/" in f"/{lf.path}" or "modeling_" in lf.path)
    backward = any(f.function in ("backward", "_engine_run_backward", "run_backward") for f in frames) or (
        not frames and bool(re.search(r"\bin backward\b|\.backward\(", text)))
    device = next((s.device for s in reversed(signals) if s.device), None)
    return ev.Context(ops=ev.op_context(codes), backward=backward, library_model=library_model,
                      autocast=bool(_AUTOCAST.search(text)), device=device,
                      norm_upstream=bool(_NORM_WORD.search(text)), has_frames=bool(frames))


def _weigh(text: str, signals: list[Signal], frames: list[Frame]) -> _Tally:
    tally = _Tally()
    ctx = _context(text, signals, frames)
    # 1. the message's wording; the last signal is the error itself, earlier ones (chained or
    # repeated messages) count less
    seen_families: set[str] = set()
    for i, sig in enumerate(reversed(signals)):
        if sig.family in seen_families:
            continue
        seen_families.add(sig.family)
        scale = 1.0 if i == 0 else 0.5
        tally.add(ev.FAMILY_WEIGHTS.get(sig.family, {}), f"message: {sig.describe()}", scale)
        for weights, why in ev.context_weights(sig.family, sig.roles, sig.first, sig.second, sig.op, ctx):
            tally.add(weights, why, scale)
    # 2. frames: each clue once, named by the first frame it matched
    keys = [_frame_key(f) for f in frames]
    for clue in ev.FRAME_CLUES:
        hit = next((f for f, k in zip(frames, keys, strict=True) if clue.regex.search(k)), None)
        if hit is not None:
            tally.add(clue.weights, f"frame: {clue.name} ({hit})")
    # 3. words in the text: the user's prose, the message, the innermost code
    words = evidence_text(text, frames) if frames else text
    adapter_seen = False
    for clue in ev.TEXT_CLUES:
        m = clue.regex.search(words)
        if m is not None:
            tally.add(clue.weights, f"text: {clue.name} ({m.group(0).strip()!r})", 0.75 if frames else 1.0)
            adapter_seen = adapter_seen or clue.name in ev.ADAPTER_CLUES
    adapter_seen = adapter_seen or any(c.name in ev.ADAPTER_CLUES and any(c.regex.search(k) for k in keys)
                                       for c in ev.FRAME_CLUES)
    if not adapter_seen and "linear" not in ctx.ops and tally.scores[ev.ADA] > 0:
        # a generic mismatch spreads weight on adapters, but adapters are something the text must
        # show (peft/LoRA/unsloth frames or words, or at least a Linear layer failing, where
        # adapters wrap): without that, the plain causes come first
        tally.scores[ev.ADA] *= 0.5
    return tally


def _rank(tally: _Tally) -> tuple[list[tuple[str, float]], float]:
    ranked = sorted(tally.scores.items(), key=lambda kv: -kv[1])
    top = ranked[0][1]
    exps = {c: math.exp((s - top) / _TEMPERATURE) for c, s in ranked}
    total = sum(exps.values())
    probs = [(c, exps[c] / total) for c, _ in ranked]
    return probs, top


def _rule_for(category: str | None) -> str | None:
    if category is None:
        return None
    from castwise.rules import REGISTRY

    order = {"error": 0, "warning": 1, "info": 2}
    rules = sorted((r for r in REGISTRY.values() if r.category == category),
                   key=lambda r: (order.get(r.severity, 3), r.code))
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


def explain(error: BaseException | str) -> Explanation:
    """Explain a mixed-precision dtype error: ``error`` is an exception, or the text of an error
    message, traceback or log. Returns the ranked root causes, the locus and the fixes."""
    raw = _focus(error_text(error))
    # castwise's own notes (an annotated error pasted back) are conclusions, not evidence
    text = "\n".join(line for line in raw.splitlines() if not line.startswith("castwise:"))
    signals = read_signals(text)
    frames = parse_frames(text)
    listing = numbered_code(text)
    if listing and not frames:  # IPython listings without frame headers still show the code
        frames = [Frame(file="<listing>", line=None, function=None, code=c, path="") for c in listing[-3:]]
    tally = _weigh(text, signals, frames)
    probs, top = _rank(tally)
    has_dtype_words = bool(DTYPE_MENTION.search(text))
    dtype_signal = any(s.dtype_error for s in signals)
    sig = signals[-1] if signals else None

    if top < _MIN_SCORE:
        category = None
        candidates: tuple[Candidate, ...] = ()
        confidence = 0.0
    else:
        category = probs[0][0]
        confidence = probs[0][1]
        floor = max(0.03, probs[0][1] * 0.1)
        kept = [(c, p) for c, p in probs if tally.scores[c] > 0 and p >= floor][:_MAX_CANDIDATES]
        # thin evidence: always show the runners-up, so the user sees the alternatives
        if confidence < 0.6:
            kept = [(c, p) for c, p in probs if tally.scores[c] > 0][:max(3, len(kept))]
        candidates = tuple(Candidate(c, p, CATEGORIES[c].title) for c, p in kept)

    real_frames = [f for f in frames if f.file != "<listing>"]
    lf = locus_frame(real_frames)
    # a module path in the text: castwise.diagnose()'s own note, when an annotated error is pasted
    named = _MODULE_NOTE.search(raw)
    module = named.group(1) if named else None
    locus = Locus(lf.file, lf.line, lf.function, lf.library, lf.code, module) if lf is not None else None
    if locus is None and (frames or module):
        locus = Locus(None, None, None, None, frames[-1].code if frames else None, module)

    if category is None and sig is not None and sig.family == "device-mismatch":
        title = "not a dtype error: one dtype on two devices"
        cause = (f"Both tensors are {short(sig.first or '?')}; the message names them by device type (CUDA vs "
                 "CPU tensor). Move the input or the module to the same device (`x.to(next(model.parameters())"
                 ".device)`).")
        fixes: tuple[str, ...] = ()
        evidence: tuple[str, ...] = ()
    elif category is None and sig is not None and sig.dtype_error:
        title = "a dtype error, but no mixed-precision cause fits"
        names = " and ".join(short(d) for d in sig.dtypes) or "two dtypes"
        cause = (f"{sig.op or 'An op'} got {names}: not a clash between floating precisions (an integer index "
                 "or label tensor, or a dtype castwise does not reason about). Cast the tensor to the dtype "
                 "the op documents.")
        fixes = ()
        evidence = ()
    elif category is None:
        title = "no evidence of a mixed-precision dtype error"
        cause = ("Nothing in the text names a dtype mismatch, a precision setting or a library castwise "
                 "knows. Paste the full traceback with the error message.")
        fixes = ()
        evidence = ()
    else:
        title = CATEGORIES[category].title
        cause = _cause(category, sig)
        fixes = FIXES.get(category, ())
        reasons = sorted(tally.reasons[category], key=lambda r: -r[0])
        evidence = tuple(dict.fromkeys(r for _, r in reasons))[:6]

    dtypes = tuple(dict.fromkeys(d for s in signals for d in s.dtypes))
    return Explanation(
        category=category,
        candidates=candidates,
        title=title,
        cause=cause,
        fixes=fixes,
        locus=locus,
        confidence=confidence,
        rule=_rule_for(category),
        error=_error_line(text, signals),
        signal=sig.describe() if sig else None,
        dtypes=dtypes,
        evidence=evidence,
        is_dtype_error=category is not None and (dtype_signal or (has_dtype_words and top >= 4.0)),
        frames=tuple(real_frames),
    )


# -- rendering ------------------------------------------------------------------------------

_LABEL = 10


def _field(label: str, text: str, width: int = WIDTH) -> list[str]:
    return textwrap.fill(" ".join(text.split()), width=width, initial_indent=f"  {label:<{_LABEL}}",
                         subsequent_indent=" " * (2 + _LABEL), break_on_hyphens=False,
                         break_long_words=True).splitlines()


def render(e: Explanation, width: int = WIDTH) -> str:
    """The explanation as text for a terminal ``width`` columns wide (100 by default)."""
    if e.category is None:
        lines = [f"castwise explain: {e.title}"]
        if e.error:
            lines += _field("error", e.error, width)
        lines += _field("note", e.cause, width)
        return "\n".join(lines)
    lines = [f"castwise explain: {e.category}  (confidence {e.level}, {e.confidence:.2f})"]
    lines += textwrap.wrap(e.title, width=width, initial_indent="  ", subsequent_indent="  ")
    if e.rule:
        from castwise.rules import REGISTRY

        name = REGISTRY[e.rule].name if e.rule in REGISTRY else ""
        lines += _field("rule", f"{e.rule} {name} (`castwise rules {e.rule}` for the page)", width)
    if e.error:
        lines += _field("error", e.error, width)
    if e.signal:
        lines += _field("read as", e.signal, width)
    if e.locus is not None:
        lines += _field("at", str(e.locus), width)
        if e.locus.code:
            lines += _field("", e.locus.code, width)
    lines += _field("cause", e.cause, width)
    for i, fix in enumerate(e.fixes, 1):
        lines += _field("fix" if i == 1 else "", f"{i}. {fix}", width)
    for i, why in enumerate(e.evidence[:4]):
        lines += _field("evidence" if i == 0 else "", why, width)
    others = [c for c in e.candidates if c.category != e.category]
    if others:
        lines.append("")
        head = "other candidates" if e.level == "high" else "not enough evidence to be sure; also possible"
        lines += textwrap.wrap(f"{head}:", width=width, initial_indent="  ")
        for c in others:
            lines += textwrap.wrap(f"{c.score:4.2f}  {c.category}: {c.title}", width=width,
                                   initial_indent="    ", subsequent_indent="          ")
    return "\n".join(lines)
