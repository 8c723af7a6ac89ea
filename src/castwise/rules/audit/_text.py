"""Wording shared by the audit rules' messages and fixes (torch-free)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from castwise._dtypes import short_of

if TYPE_CHECKING:
    import torch


def generalize(name: str) -> str:
    """``blocks.0.attn.q_norm`` -> ``blocks.*.attn.q_norm``: one rule for every repeated block.
    A name of indices only (``0``, ``2.1``: an ``nn.Sequential``'s children) stays as it is: all
    stars would select every module of that depth, not a repeated block."""
    parts = name.split(".")
    if all(seg.isdigit() for seg in parts):
        return name
    return ".".join("*" if seg.isdigit() else seg for seg in parts)


def is_ancestor(parent: str, child: str) -> bool:
    return parent == "" or child == parent or child.startswith(parent + ".")


def where(module: str) -> str:
    return f"`{module}`" if module else "the model's top level"


def keep_fix(module: str, what: str = "Run") -> str:
    """How to make ``module`` a float32 island: a keep rule, or in words for the top level (no
    module rule selects the root: ``keep[]`` is not a selector)."""
    if module:
        return f"{what} `{module}` as a float32 island: policy rule `keep[{generalize(module)}]=f32`"
    return (
        f"{what} that op in float32 in the model's top-level forward (`x.float()` before it and a cast "
        "back after it; a module rule cannot select the top level: move the op into a submodule and "
        "`keep[<that submodule>]=f32`)"
    )


def module_expr(name: str) -> str:
    """Python for the submodule ``name`` of ``model`` (get_submodule when a segment is an index)."""
    if all(seg.isidentifier() for seg in name.split(".")):
        return f"model.{name}"
    return f"model.get_submodule({name!r})"


def true_preset(dtype: torch.dtype) -> str:
    return "16-true" if short_of(dtype) == "f16" else "bf16-true"


def others(dtypes: tuple[torch.dtype, ...], culprits: list[int]) -> str:
    rest = {short_of(d) for i, d in enumerate(dtypes) if i not in culprits and d.is_floating_point}
    return ", ".join(sorted(rest))


_FACTORY = re.compile(
    r"\btorch\.(arange|zeros|ones|full|empty|tensor|linspace|logspace|rand|randn|eye|zeros_like|ones_like|"
    r"full_like|empty_like)\("
)


def dtype_code_fix(source: str | None, dtype_expr: str) -> tuple[str, int, str, str | None] | None:
    """The line at ``source`` ("file.py:42") with ``dtype=<dtype_expr>`` added to its torch factory
    call, when the line has one without a dtype; None otherwise."""
    if not source or ":" not in source:
        return None
    path, _, num = source.rpartition(":")
    if not num.isdigit():
        return None
    import linecache
    import os

    full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    text = linecache.getline(full, int(num)).rstrip("\n") or linecache.getline(path, int(num)).rstrip("\n")
    match = _FACTORY.search(text)
    if not text or match is None or "dtype=" in text:
        return None
    depth, end = 0, None
    for i in range(match.end() - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            end = i
            break
    if end is None:
        return None
    empty = text[match.end() : end].strip() == ""
    replaced = text[:end] + ("" if empty else ", ") + f"dtype={dtype_expr}" + text[end:]
    return path, int(num), replaced, text
