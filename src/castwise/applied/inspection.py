"""What a policy does to one model: which modules are islands or get output casts.

``resolve(policy, model)`` reads the policy's module rules, the model's
``_keep_in_fp32_modules`` and the ``norms`` default, in that order of precedence, into one
``Decision`` per module; ``apply`` carries them out. ``unmatched_rules`` finds the user's rules
that select no module (a typo in a selector changes the policy silently), with the selector
that would match.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from castwise._dtypes import short_of
from castwise.errors import RuleError
from castwise.policy import ModuleRule, Policy
from castwise.policy.selectors import suggest

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "NORM_CLASS_NAMES",
    "Decision",
    "is_norm",
    "resolve",
    "unmatched_message",
    "unmatched_rules",
    "warn_unmatched",
]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


NORM_CLASS_NAMES = re.compile(r"(?i).*(LayerNorm|RMSNorm|GroupNorm|BatchNorm\d?d?|InstanceNorm\d?d?|LayerNormFp32)$")


def is_norm(module: nn.Module) -> bool:
    """Normalisation layers: torch's norm classes and library norms named like them
    (OpenCLIP's LayerNormFp32, transformers' T5LayerNorm/LlamaRMSNorm, ...) that own parameters
    or buffers and no child modules."""
    from torch import nn

    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)):
        return True
    if next(module.children(), None) is not None:
        return False
    if not any(True for _ in module.parameters(recurse=False)) and not any(True for _ in module.buffers(recurse=False)):
        return False
    return any(NORM_CLASS_NAMES.fullmatch(cls.__name__) for cls in type(module).__mro__)


def _keep_in_fp32_names(model: nn.Module, compute: torch.dtype) -> list[str]:
    """Entries of transformers' ``_keep_in_fp32_modules`` (honoured, as transformers does, only
    when running in float16) and ``_keep_in_fp32_modules_strict`` (float16 and bfloat16)."""
    attrs = {
        F16: ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"),
        BF16: ("_keep_in_fp32_modules_strict",),
    }.get(compute, ())
    names: list[str] = []
    for module in model.modules():
        for attr in attrs:
            keep = getattr(module, attr, None)
            if isinstance(keep, (list, tuple, set, frozenset)):
                names += [str(k) for k in keep]
    return sorted(set(names))


def _matches_segments(name: str, keep: Iterable[str]) -> str | None:
    """transformers' _keep_in_fp32_modules entries matched on whole dotted segments (transformers
    5.x matches substrings, so its ``wo`` also catches ``word_embeddings``)."""
    segments = name.split(".")
    for entry in keep:
        parts = entry.split(".")
        n = len(parts)
        if any(segments[i : i + n] == parts for i in range(len(segments) - n + 1)):
            return entry
    return None


@dataclass(frozen=True)
class Decision:
    """What a policy does to one module."""

    island: torch.dtype | None = None  # run as an island in this dtype
    island_reason: str | None = None  # "rule keep[...]", "_keep_in_fp32_modules 'wo'", "norms"
    output: torch.dtype | None = None  # cast floating outputs to this dtype
    output_reason: str | None = None


def _rule_decision(policy: Policy, name: str, module: nn.Module, kind: str) -> ModuleRule | None:
    """The user's rule of ``kind`` for one module; RuleError when two disagree."""
    hits = [r for r in policy.rules if r.kind == kind and r.matches(name, module)]
    if len({r.dtype for r in hits}) > 1:
        a, b = hits[0], next(r for r in hits if r.dtype != hits[0].dtype)
        raise RuleError(
            f"module {name or '(root)'!r} ({type(module).__name__}) is matched by {a} and {b}, "
            "which disagree; make one selector narrower or drop one rule"
        )
    return hits[0] if hits else None


def _decide(policy: Policy, name: str, module: nn.Module, keep_names: list[str]) -> Decision | None:
    """One module's decision: user rule, then _keep_in_fp32_modules, then the norms default."""
    keep, out = _rule_decision(policy, name, module, "keep"), _rule_decision(policy, name, module, "out")
    island, island_reason = (keep.dtype, f"rule {keep}") if keep is not None else (None, None)
    output, output_reason = (out.dtype, f"rule {out}") if out is not None else (None, None)
    if island is None and keep_names and name:
        entry = _matches_segments(name, keep_names)
        if entry is not None:
            island, island_reason = F32, f"_keep_in_fp32_modules {entry!r}"
    if island is None and policy.norms is not None and policy.norms != policy.compute_dtype and is_norm(module):
        island, island_reason = policy.norms, "norms"
    if island is not None and island == policy.param_dtype and not policy.is_mixed and island_reason == "norms":
        island = None
    if island is None and output is None:
        return None
    return Decision(island, island_reason, output, output_reason)


def resolve(policy: Policy, model: nn.Module) -> dict[str, Decision]:
    """Which modules of ``model`` are islands or get output casts under ``policy``.

    Raises RuleError when two user rules of one kind match one module with different dtypes.
    Only modules with a decision are in the result; the root is named ``""``.
    """
    keep_names = _keep_in_fp32_names(model, policy.compute_dtype) if policy.keep_in_fp32 else []
    out: dict[str, Decision] = {}
    for name, module in model.named_modules():
        decision = _decide(policy, name, module, keep_names)
        if decision is not None:
            out[name] = decision
    # an island inside an island of the same dtype adds nothing: keep the outermost
    names = sorted(out, key=lambda n: n.count(".") if n else -1)
    for name in names:
        d = out[name]
        if d.island is None:
            continue
        parent = _enclosing_island(name, out)
        if parent is not None and out[parent].island == d.island:
            out[name] = Decision(None, None, d.output, d.output_reason)
            if out[name].output is None:
                del out[name]
    return out


def _enclosing_island(name: str, decisions: dict[str, Decision]) -> str | None:
    parts = name.split(".") if name else []
    for i in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:i])
        d = decisions.get(prefix)
        if d is not None and d.island is not None and prefix != name:
            return prefix
    return None


# -- rules that select nothing -----------------------------------------------------------------


def unmatched_rules(policy: Policy, model: nn.Module) -> list[tuple[ModuleRule, list[str]]]:
    """The user's rules that match no module of ``model``, each with the selectors that would
    match (best first; empty when castwise has no guess). Rules a preset brings (Apex O2's
    BatchNorm rule) are not the user's and are left out."""
    named = list(model.named_modules())
    built_in = {r for preset in Policy.presets().values() for r in preset.rules}
    names = [n for n, _ in named]
    classes = sorted({type(m).__name__ for _, m in named})
    out: list[tuple[ModuleRule, list[str]]] = []
    for rule in policy.rules:
        if rule in built_in or any(rule.matches(name, module) for name, module in named):
            continue
        out.append((rule, suggest(rule.selector_text, names, classes)))
    return out


def unmatched_message(rule: ModuleRule, suggestions: list[str], model: nn.Module) -> str:
    """What to tell the user about a rule that matches nothing: the rule, and the fix."""
    head = f"rule {rule} matches no module of {type(model).__name__}, so the policy runs without it"
    if suggestions:
        alternatives = " or ".join(f"{rule.kind}[{s}]={short_of(rule.dtype)}" for s in suggestions)
        return f"{head}; did you mean {alternatives}?"
    return (
        f"{head}; check the selector (globs match whole dotted names: '*' is one segment and '**' any "
        "number, so '*.wo' matches 'encoder.wo' but not 'encoder.block.0.wo' or 'wo_proj')"
    )


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points ``warnings.warn`` (called by the caller of this function)
    at the first frame outside castwise: the user's line, however deep castwise called apply."""
    frame = sys._getframe(1)  # the function about to call warnings.warn: stacklevel 1
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "castwise":
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn_unmatched(policy: Policy, model: nn.Module) -> None:
    """Warn (``UserWarning``, at the user's line) for each rule that matches no module."""
    for rule, suggestions in unmatched_rules(policy, model):
        warnings.warn(
            f"castwise: {unmatched_message(rule, suggestions, model)}", UserWarning, stacklevel=_user_stacklevel()
        )
