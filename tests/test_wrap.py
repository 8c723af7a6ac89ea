"""castwise._wrap: word wrap whose units (words, `code spans`, calls with their arguments) are never cut."""

from __future__ import annotations

import textwrap

from castwise._wrap import units, wrap


def test_units_keep_code_spans_and_calls_whole_and_prose_parentheses_open() -> None:
    text = "run `castwise audit x.py:build --real` or f(a, b[1, 2]) (a note, in prose) bf16[2, 4]"
    assert [u for _, u in units(text)] == [
        "run",
        "`castwise audit x.py:build --real`",
        "or",
        "f(a, b[1, 2])",
        "(a",
        "note,",
        "in",
        "prose)",
        "bf16[2, 4]",
    ]


def test_an_unclosed_backtick_or_bracket_is_a_plain_word() -> None:
    assert [u for _, u in units("a `b c and f(x y")] == ["a", "`b", "c", "and", "f(x", "y"]


def test_prose_wraps_as_textwrap_does() -> None:
    text = "the quick brown fox jumps over the lazy dog " * 6
    for width in (20, 33, 60):
        expected = textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ")
        assert wrap(text, width, "  ", "    ") == expected
    assert wrap("   ", 10) == []


def test_a_unit_longer_than_a_line_overflows_uncut_unless_plain_text_may_be_split() -> None:
    policy = "bf16-mixed,keep[" + "a" * 40 + "]=f32"
    assert wrap(f"use {policy} now", 30) == ["use", policy, "now"]
    cut = wrap("x" * 50 + " end", 20, split_plain=True)
    assert cut == ["x" * 20, "x" * 20, "x" * 10 + " end"]
    assert wrap(f"use {policy}", 30, split_plain=True) == ["use", policy]  # code is never cut
