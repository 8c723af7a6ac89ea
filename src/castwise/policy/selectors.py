"""Module rules: which modules a ``keep[...]``/``out[...]`` clause selects (torch-free at import).

A selector is a glob on dotted name segments (``*`` one segment, ``**`` any number),
``re:REGEX`` (full match on the qualified name), ``class:NAME`` (the module's class or a base
class), a module class, or a predicate ``(name, module) -> bool``. ``suggest`` proposes the
selector a user most likely meant when theirs matches no module.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from castwise import _dtypes
from castwise.errors import RuleError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ModuleRule", "Predicate", "RuleKind", "Selector", "suggest"]

Predicate = Callable[[str, "nn.Module"], bool]
Selector = str | type | Predicate  # a class is stored as its "class:module.QualName" string
RuleKind = Literal["keep", "out"]

_SELECTOR_FORMS = "a glob like '*.wo', 're:REGEX' or 'class:Name'"


def _class_names(cls: type) -> set[str]:
    return {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}


def _class_regex(segment: str, i: int) -> tuple[str, int]:
    """The ``[...]``/``[!...]`` character class starting at ``segment[i]``, as a regex that never
    matches a dot, and the index of its closing bracket (``i`` itself when it has none)."""
    j = i + 1
    j += segment[j : j + 1] == "!"
    j += segment[j : j + 1] == "]"  # a ']' first in the class is literal, as in fnmatch
    close = segment.find("]", j)
    if close < 0:
        return re.escape("["), i
    body = segment[i + 1 : close]
    negate = body.startswith("!")
    body = "".join("\\" + c if c in "\\[]^" else c for c in (body[1:] if negate else body))
    return "[" + ("^." if negate else "") + body + "]", close


def _segment_regex(segment: str) -> str:
    """One dotted segment of a glob, as fnmatch reads it but never crossing a dot: ``*`` any
    run, ``?`` one character, ``[...]``/``[!...]`` a character class; the rest literal."""
    out, i, n = "", 0, len(segment)
    while i < n:
        ch = segment[i]
        if ch == "*":
            out += r"[^.]*"
        elif ch == "?":
            out += r"[^.]"
        elif ch == "[":
            part, i = _class_regex(segment, i)
            out += part
        else:
            out += re.escape(ch)
        i += 1
    return out


def _glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Glob on dotted segments: ``*`` one segment, ``**`` zero or more segments."""
    parts: list[str | None] = [None if seg == "**" else _segment_regex(seg) for seg in pattern.split(".")]
    out = ""
    for i, part in enumerate(parts):
        if part is None:
            # zero or more whole segments, with the dots that join them
            out += r"(?:[^.]+(?:\.[^.]+)*)?" if i == len(parts) - 1 else r"(?:[^.]+\.)*"
            continue
        out += part
        if i < len(parts) - 1 and parts[i + 1] is not None:
            out += r"\."
        elif i < len(parts) - 1:
            out += r"(?:\.|$)" if i + 1 == len(parts) - 1 else r"\."
    return re.compile(out)


@dataclass(frozen=True)
class ModuleRule:
    """Pin modules to a dtype: ``kind="keep"`` makes them islands, ``"out"`` casts outputs.

    ``selector``: a glob on dotted names (``"*.wo"``), ``"re:..."``, ``"class:Name"``, a module
    class (stored as ``"class:module.QualName"`` so the rule prints and parses back), or a
    predicate ``(name, module) -> bool``.
    """

    selector: Selector
    dtype: torch.dtype
    kind: RuleKind = "keep"
    _match: Callable[[str, Any], bool] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in ("keep", "out"):
            raise RuleError(f"rule kind {self.kind!r} is not valid; valid: keep, out")
        if not _dtypes.is_policy_dtype(self.dtype):
            raise RuleError(f"rule dtype {self.dtype!r} is not valid; valid: {_dtypes.POLICY_DTYPES_TEXT}")
        selector = self.selector
        if isinstance(selector, type):
            selector = f"class:{selector.__module__}.{selector.__qualname__}"
            object.__setattr__(self, "selector", selector)
        if isinstance(selector, str):
            object.__setattr__(self, "_match", _compile_selector(selector))
        elif callable(selector):
            predicate = selector
            object.__setattr__(self, "_match", lambda name, module: bool(predicate(name, module)))
        else:
            raise RuleError(
                f"rule selector {selector!r} is not valid; valid: a glob like '*.wo', 're:REGEX', "
                "'class:Name', a module class, or a predicate (name, module) -> bool"
            )

    def matches(self, name: str, module: nn.Module) -> bool:
        return self._match(name, module)

    @property
    def selector_text(self) -> str:
        if isinstance(self.selector, str):
            return self.selector
        fn = self.selector
        return f"fn:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def __str__(self) -> str:
        return f"{self.kind}[{self.selector_text}]={_dtypes.short_of(self.dtype)}"


def _by_class(wanted: str) -> Callable[[str, Any], bool]:
    # torch re-exports classes under shorter paths (torch.nn.LayerNorm): match the tail too
    tail = wanted.rsplit(".", 1)[-1]

    def by_class(name: str, module: Any) -> bool:
        for cls in type(module).__mro__:
            names = _class_names(cls)
            if wanted in names or ("." in wanted and tail == cls.__name__ and _same_home(wanted, cls)):
                return True
        return False

    return by_class


def _compile_selector(selector: str) -> Callable[[str, Any], bool]:
    if not selector.strip():
        raise RuleError(f"empty rule selector; valid: {_SELECTOR_FORMS}")
    if selector.startswith("fn:"):
        raise RuleError(
            f"{selector!r}: predicate rules cannot be parsed from text; pass a callable "
            "ModuleRule(lambda name, module: ..., dtype) in Python"
        )
    if selector.startswith("re:"):
        try:
            regex = re.compile(selector[3:])
        except re.error as exc:
            raise RuleError(f"rule selector {selector!r}: bad regular expression ({exc})") from None
        return lambda name, module: regex.fullmatch(name) is not None
    if selector.startswith("class:"):
        wanted = selector[len("class:") :].strip()
        if not wanted:
            raise RuleError("rule selector 'class:' names no class; e.g. 'class:LayerNorm'")
        return _by_class(wanted)
    regex = _glob_to_regex(selector)
    return lambda name, module: regex.fullmatch(name) is not None


def _same_home(dotted: str, cls: type) -> bool:
    """``torch.nn.LayerNorm`` names ``torch.nn.modules.normalization.LayerNorm``: same package."""
    package = dotted.rsplit(".", 1)[0]
    return cls.__module__ == package or cls.__module__.startswith(package + ".")


# -- what the user most likely meant -----------------------------------------------------------


def _glob_hits(pattern: str, names: Sequence[str]) -> list[str]:
    regex = _glob_to_regex(pattern)
    return [n for n in names if n and regex.fullmatch(n)]


def _generalise(hits: Sequence[str]) -> str | None:
    """One glob that names exactly the modules in ``hits``: numbered segments (``layers.0``,
    ``layers.1``) become ``*``. None when the hits differ elsewhere."""
    shapes = {".".join("*" if seg.isdigit() else seg for seg in name.split(".")) for name in hits}
    return shapes.pop() if len(shapes) == 1 else None


def _closest(word: str, choices: Sequence[str], cutoff: float) -> str | None:
    """The choice nearest ``word``, ignoring case (``LlamaMlp`` -> ``LlamaMLP``)."""
    lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), sorted(lower), n=1, cutoff=cutoff)
    return lower[close[0]] if close else None


def _respelt(selector: str, names: Sequence[str]) -> str | None:
    """The glob with each misspelt literal segment replaced by the nearest segment the model has
    (``model.layer.*.mlp`` -> ``model.layers.*.mlp``); None when no segment changed."""
    words = sorted({seg for n in names if n for seg in n.split(".") if not seg.isdigit()})
    fixed = []
    for seg in selector.split("."):
        literal = not any(c in seg for c in "*?[")
        fixed.append((_closest(seg, words, 0.75) or seg) if literal and seg not in words else seg)
    candidate = ".".join(fixed)
    return candidate if candidate != selector else None


def _widened(glob: str, names: Sequence[str]) -> list[str]:
    """The usual slip: ``*`` is one segment, so ``*.mlp`` (or ``mlp``) only reaches top-level
    children: ``**.mlp``, and the one-``*``-per-segment path when all hits share it."""
    segments = glob.split(".")
    if len(segments) > 1 and segments[0] not in ("*", "**"):
        return []  # an anchored path: widening it would select other modules than meant
    while segments and segments[0] in ("*", "**"):
        segments = segments[1:]
    if not segments:
        return []
    wide = "**." + ".".join(segments)
    hits = _glob_hits(wide, names)
    if not hits:
        return []
    exact = _generalise(hits)
    return [wide] + ([exact] if exact and exact != wide else [])


def _suggest_glob(selector: str, names: Sequence[str]) -> list[str]:
    respelt = _respelt(selector, names)
    for glob in (selector, respelt):
        if glob is None:
            continue
        found = ([glob] if glob != selector and _glob_hits(glob, names) else []) + _widened(glob, names)
        if found:
            return list(dict.fromkeys(found))[:2]
    return []


def suggest(selector: str, names: Sequence[str], classes: Sequence[str] = ()) -> list[str]:
    """Selectors that match where ``selector`` matches nothing, best first (empty: no idea).

    ``names``: the model's qualified module names; ``classes``: its module class names.
    ``suggest("*.mlp", llama_names)`` -> ``["**.mlp", "model.layers.*.mlp"]``.
    """
    if selector.startswith("class:"):
        wanted = selector[len("class:") :].strip().rsplit(".", 1)[-1]
        close = _closest(wanted, sorted(set(classes)), 0.6)
        return [f"class:{close}"] if close else []
    if selector.startswith(("re:", "fn:")):
        return []
    return _suggest_glob(selector, names)
