"""Word wrap for castwise's terminal text that never breaks a policy or a piece of code.

``textwrap`` breaks a word longer than the room left on a line across two lines
(``out[_orig_mod.transf`` / ``ormer.h.*.ln_2]``), and breaks a call at the spaces between its
arguments. Here the units of a line are: a `backtick span` (spaces and all), a call or index
with its arguments (``Policy.parse('bf16-mixed', x)``, ``bf16[2, 4]``: a bracket right after a
name, up to its match), and any other run of non-space characters. A unit is never split to
fill a line: it moves to the next line whole, and one longer than a whole line overflows it
(``split_plain`` allows splitting such a unit when it holds no code: pasted error text).
"""

from __future__ import annotations

_OPEN, _CLOSE = "([{", ")]}"


def _code_end(text: str, start: int) -> int:
    """The end of the unit starting at ``start``, or -1 when a backtick or bracket it opens is
    never closed (then the unit is a plain word)."""
    tick, depth, k, n = False, 0, start, len(text)
    while k < n:
        c = text[k]
        if c == "`":
            tick = not tick
        elif not tick:
            if c in _OPEN and (depth or (k > start and (text[k - 1].isalnum() or text[k - 1] in "_.])"))):
                depth += 1
            elif c in _CLOSE and depth:
                depth -= 1
            elif c.isspace() and not depth:
                return k
        k += 1
    return -1 if tick or depth else n


def units(text: str) -> list[tuple[str, str]]:
    """``(the whitespace before it, unit)`` for each unit of ``text``; whitespace becomes spaces."""
    out: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        j = i
        while j < n and text[j].isspace():
            j += 1
        if j >= n:
            break
        k = _code_end(text, j)
        if k < 0:  # an unclosed ` or bracket: only up to the next space belongs to this word
            k = j
            while k < n and not text[k].isspace():
                k += 1
        out.append((" " * (j - i), "".join(" " if c.isspace() else c for c in text[j:k])))
        i = k
    return out


def _is_code(unit: str) -> bool:
    return any(c in unit for c in "`([{=,")


def wrap(
    text: str, width: int, initial_indent: str = "", subsequent_indent: str = "", *, split_plain: bool = False
) -> list[str]:
    """``text`` as lines of at most ``width`` columns (indents included) where its units allow;
    ``[]`` for blank text, as ``textwrap.wrap``."""
    lines: list[str] = []
    line, has_unit = initial_indent, False
    full = max(1, width - len(subsequent_indent))  # the room on a line of its own
    for space, unit in units(text):
        sep = space if has_unit else ""
        if split_plain and len(unit) > full and not _is_code(unit):
            # pasted text holding no code: cut, as textwrap does, so that the lines keep the width
            room = width - len(line) - len(sep)
            if room < 1:
                lines.append(line)
                line, sep, room = subsequent_indent, "", full
            line += sep + unit[:room]
            rest = unit[room:]
            while rest:
                lines.append(line)
                line, rest = subsequent_indent + rest[:full], rest[full:]
            has_unit = True
            continue
        if has_unit and len(line) + len(sep) + len(unit) > width:
            lines.append(line)
            line, sep = subsequent_indent, ""
        line += sep + unit
        has_unit = True
    if has_unit:
        lines.append(line)
    return lines


def fill(
    text: str, width: int, initial_indent: str = "", subsequent_indent: str = "", *, split_plain: bool = False
) -> str:
    return "\n".join(wrap(text, width, initial_indent, subsequent_indent, split_plain=split_plain))


__all__ = ["fill", "units", "wrap"]
