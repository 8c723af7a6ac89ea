"""The policy string grammar: split into clauses, read them, print them back (torch-free at import).

``read(text)`` turns a precision string into its parts (a preset name, the clause values as
written, the module rules) and ``clauses_against(values, base)`` prints the clauses that turn
one set of field values into another; ``castwise.policy.core.Policy`` builds on both. The
grammar itself is documented in ``castwise.policy``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from castwise import _dtypes
from castwise.errors import PolicyError
from castwise.policy import fields, presets, vocab
from castwise.policy.selectors import ModuleRule

__all__ = ["Parsed", "clauses_against", "read", "split"]

_RULE_HEAD = re.compile(r"\s*(?:keep|out)\[")
# where a rule clause ends: ']=' and a dtype, then a comma or the end of the string
_RULE_TAIL = re.compile(r"\]\s*=\s*([^,\]]*?)\s*(?:,|$)")
_RULE_CLAUSE = re.compile(r"(keep|out)\[(.*)\]\s*=\s*(.*)", re.S)
_PLAIN_KEYS = frozenset(c for c in fields.CLAUSE_KEYS if "[" not in c)


def _clause_end(text: str, i: int) -> int:
    """Where the clause starting at ``i`` ends (after its comma, or the string's end)."""
    head = _RULE_HEAD.match(text, i)
    if head is not None:
        for tail in _RULE_TAIL.finditer(text, head.end()):
            if _dtypes.canonical(tail.group(1)) is not None:
                return tail.end()
    depth = 0  # a tool's recipe call (te:DelayedScaling(fp8_format=..., margin=0)) keeps its commas
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth = max(depth - 1, 0)
        elif text[j] == "," and depth == 0:
            return j + 1
    return len(text)


def split(text: str) -> list[str]:
    """Split on the commas between clauses. A rule's selector may hold commas, brackets and
    '=' (a regex): a ``keep[``/``out[`` clause runs to the first ``]=DTYPE`` that is followed by
    a comma or the end of the string; commas inside parentheses (a tool's recipe call) stay."""
    parts: list[str] = []
    i, n = 0, len(text)
    while True:
        end = _clause_end(text, i)
        clause = text[i:end]
        trailing = clause.endswith(",")
        parts.append(clause[:-1] if trailing else clause)
        i = end
        if i >= n:
            if trailing:
                parts.append("")
            break
    parts = [p.strip() for p in parts]
    if any(not p for p in parts) and len(parts) > 1:
        raise PolicyError(f"empty clause in {text!r} (two commas in a row, or a trailing comma)")
    return [p for p in parts if p]


@dataclass(frozen=True)
class Parsed:
    """A policy string's parts: the preset it starts with (None: clauses only), each plain
    clause's value as written (``{"compute": "bf16"}``) and the module rules in order."""

    preset: str | None
    given: Mapping[str, str]
    rules: tuple[ModuleRule, ...]


def _no_equals(clause: str) -> PolicyError:
    hint = " (a preset may only come first)" if clause in presets.PRESETS else ""
    return PolicyError(f"clause {clause!r} has no '='{hint}; valid clauses: {', '.join(fields.CLAUSE_KEYS)}")


def read(text: str) -> Parsed:
    """A policy string's parts; PolicyError (or RuleError for a selector) naming what is wrong."""
    clauses = vocab.translate(split(text))
    if not clauses:
        raise PolicyError(f"empty policy string; valid presets: {', '.join(sorted(presets.PRESETS))}")
    preset = None
    implied: dict[str, str] = {}  # what a prefixed string adds to its preset; the user's clauses win
    if "=" not in clauses[0]:
        preset = presets.lookup(clauses[0])
        implied = dict(c.split("=", 1) for c in presets.ecosystem_clauses(clauses[0]))
        clauses = clauses[1:]
    given: dict[str, str] = {}
    rules: list[ModuleRule] = []
    for clause in clauses:
        if "=" not in clause:
            raise _no_equals(clause)
        m = _RULE_CLAUSE.fullmatch(clause)
        if m:
            kind, selector, value = m.group(1), m.group(2), m.group(3).strip()
            dtype = fields.parse_dtype(value, f"{kind}[{selector}]")
            rules.append(ModuleRule(selector, dtype, kind))  # type: ignore[arg-type]
            continue
        key, _, value = clause.partition("=")
        key, value = key.strip().lower(), value.strip()
        if key not in _PLAIN_KEYS:
            raise PolicyError(
                f"unknown clause {key!r}{presets.did_you_mean(key, fields.CLAUSE_KEYS)}; "
                f"valid clauses: {', '.join(fields.CLAUSE_KEYS)}"
            )
        if key in given:
            raise PolicyError(f"clause {key!r} given twice")
        given[key] = value
    return Parsed(preset, {**implied, **given}, tuple(rules))


def clauses_against(values: Mapping[str, Any], base: Mapping[str, Any]) -> list[str] | None:
    """Clauses that turn ``base`` (field values with the same params/compute) into ``values``;
    None when the rules cannot be expressed by appending to the base's rules."""
    out = [
        f"{f.clause}={f.show(values[f.attr])}"
        for f in fields.FIELDS
        if f.attr not in ("param_dtype", "compute_dtype") and values[f.attr] != base[f.attr]
    ]
    rules, base_rules = tuple(values["rules"]), tuple(base["rules"])
    if rules[: len(base_rules)] != base_rules:
        return None
    return out + [str(r) for r in rules[len(base_rules) :]]
