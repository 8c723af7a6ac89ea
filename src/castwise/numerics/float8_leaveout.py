"""Which Linears to leave out of float8 training, judged by the recipe that will train them.

A Linear trains in float8 through three GEMMs: forward ``input @ weight.t()``, the input's
gradient ``grad_output @ weight`` and the weight's gradient ``grad_output.t() @ input``, whose
reduction dim is the batch's token count. A layer is left out when

- one of its operands (input, weight, grad_output) loses more than ``THRESHOLD`` of its rows
  and columns (most of their magnitude flushed to zero) once the recipe scales it (per tensor,
  per row, or per MX block of 32: ``castwise.float8.score``), which happens when its dynamic range is
  wider than the format's and the small values fill whole lines (a GEMM result column lost);
- one of its GEMMs loses features: under the recipe's scaling of both its operands along the
  reduction dim, more than ``GEMM_SHARE`` of its result features (columns; for grad_weight also
  rows, the output features) err by over ``score.threshold(scaling)`` of their terms' root-sum-square
  (``score.lost``). This sees what one operand alone cannot: a row's small values flushed
  by its own scale that meet the other operand's large ones, an MX block flushed by one outlier;
- castwise's filter, the one apply reads, leaves it out (``castwise.float8.convert.reasons``);
- one of its GEMMs breaks ``torch._scaled_mm``'s contract through the token count (or two e5m2):
  ``castwise.trace.contracts.float8`` on a simulated sm 10.0 GPU, for MX every dim in blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from castwise import devices
from castwise.float8.scaling import RECIPES, multiple
from castwise.float8.score import threshold
from castwise.policy.float8 import Float8Recipe
from castwise.trace.contracts.float8 import _scaled_mm

# the share of an operand's lines (rows, columns) lost to the flush that leaves a layer out
# (tuned on bench_float8_leaveout's seeds 0-2)
THRESHOLD = 0.05
# the per-operand score that stands for a recipe: delayed scaling is per tensor (from an amax
# history); a 1x128 block lies inside a row, so rowwise's share bounds blockwise's from above
SCORE = {**{r: r for r in RECIPES}, "delayed": "tensorwise", "blockwise": "rowwise"}
OPERANDS = ("input", "weight", "grad_output")
# the share of a GEMM's result features lost that leaves a layer out: bench_float8_leaveout's own
# measure of a bad layer (more than 1% of its features)
GEMM_SHARE = 0.01
GEMM_KEY = "gemm_"  # the observer's record of each GEMM: gemm_forward, gemm_grad_input, gemm_grad_weight
# the result lines of each GEMM that are features: a token's row of the forward result or the
# input gradient is one token's signal; the weight gradient's rows are the output features
GEMM_LINES: dict[str, tuple[str, ...]] = {
    "forward": ("cols",),
    "grad_input": ("cols",),
    "grad_weight": ("cols", "rows"),
}
# the lines of each operand whose loss loses a feature of a GEMM result: the weight's rows (output
# features) and columns (the input gradient's features); the input's and grad_output's columns
# along the tokens (the weight gradient's columns and rows). A token row lost is one token's
# signal, and the weight gradient sums over the tokens.
LINES: dict[str, tuple[str, ...]] = {"input": ("cols",), "weight": ("rows", "cols"), "grad_output": ("cols",)}


@dataclass(frozen=True)
class Gemm:
    """One float8 GEMM of a Linear: ``mat1 @ mat2`` with their shapes and float8 dtypes."""

    name: str
    mat1: tuple[int, int]
    mat2: tuple[int, int]
    dtypes: tuple[str, str]


def gemms(recipe: Float8Recipe, in_f: int, out_f: int, tokens: int, train: bool = True) -> list[Gemm]:
    """The GEMMs a float8 Linear runs (forward; with ``train`` the two backward ones)."""
    fwd, grad = recipe.forward_dtype, recipe.gradient_dtype
    found = [Gemm("forward", (tokens, in_f), (in_f, out_f), (fwd, fwd))]
    if train:
        found.append(Gemm("grad_input", (tokens, out_f), (out_f, in_f), (grad, fwd)))
        found.append(Gemm("grad_weight", (out_f, tokens), (tokens, in_f), (grad, fwd)))
    return found


def shape_problem(recipe: Float8Recipe, g: Gemm) -> str | None:
    """Why the float8 kernel refuses this GEMM (``_scaled_mm``'s own message), or None."""
    a = torch.empty(g.mat1, dtype=getattr(torch, g.dtypes[0]), device="meta")
    b = torch.empty(g.mat2, dtype=getattr(torch, g.dtypes[1]), device="meta")
    got = _scaled_mm("aten._scaled_mm", (a, b), {}, devices.get("cuda:b200"))
    if not isinstance(got, torch.dtype):
        return str(getattr(got, "message", got))
    n = multiple(recipe)
    # MX scales blocks of 32 along the reduction dim, and torchao's MX kernels tile the others by it too
    odd = [d for d in (g.mat1[0], g.mat1[1], g.mat2[1]) if d % n]
    if n != 16 and odd:
        return f"{odd[0]} is not a multiple of {n} (the {recipe.scaling} block)"
    return None


def operand_reasons(
    recipe: Float8Recipe, operands: dict[str, dict[str, float]], format_range: float
) -> tuple[dict[str, float], list[str]]:
    """Each operand's share of lost lines under ``recipe``'s scaling, and the reasons it leaves out."""
    key = SCORE[recipe.scaling]
    lost: dict[str, float] = {}
    reasons: list[str] = []
    for what in OPERANDS:
        got = operands.get(what)
        if got is None:
            continue
        share = lost[what] = max(got[f"lost_{line}_{key}"] for line in LINES[what])
        if share > THRESHOLD:
            rng = got.get("range_pow2", math.nan)
            lines = " and ".join(LINES[what])
            reasons.append(
                f"{100 * share:.1f}% of its {what}'s {lines} (features) lose most of their magnitude to zero after "
                f"{recipe.scaling} scaling ({100 * got[key]:.1f}% of its values flush; its range 2^{rng:.0f} "
                f"against the format's 2^{format_range:.0f})"
            )
    return lost, reasons


def gemm_reasons(operands: dict[str, Any], scaling: str) -> tuple[dict[str, float], list[str]]:
    """Each GEMM's share of lost result features (``score.lost``), and the reasons it leaves out."""
    lost: dict[str, float] = {}
    reasons: list[str] = []
    for name, lines in GEMM_LINES.items():
        got = operands.get(GEMM_KEY + name)
        if not isinstance(got, dict):
            continue
        share = lost[name] = max(got[f"lost_{line}"] for line in lines)
        if share > GEMM_SHARE:
            line = max(lines, key=lambda k: got[f"lost_{k}"])
            what = {"cols": "columns", "rows": "rows (output features)"}[line]
            reasons.append(
                f"{100 * share:.1f}% of its {name} GEMM's result {what} err by over {threshold(scaling):g} of "
                f"their terms' "
                f"root-sum-square (worst {got[f'worst_{line}']:.2f}) once {scaling} scaling flushes or rounds "
                "its operands"
            )
    return lost, reasons


def judge(
    recipe: Float8Recipe,
    in_f: int,
    out_f: int,
    operands: dict[str, Any],
    format_range: float,
    train: bool,
    filtered: list[str],
) -> dict[str, Any]:
    """One Linear under ``recipe``: per-operand shares, each GEMM's verdict, and the reasons to
    leave it out (empty: convert it): ``filtered`` (the filter's, apply's), then the numbers'.
    ``operands["tokens"]`` None: the token dim was not seen."""
    scored = {k: v for k, v in operands.items() if isinstance(v, dict)}
    lost, reasons = operand_reasons(recipe, scored, format_range)
    reasons = [*filtered, *reasons]
    gemm_lost, more = gemm_reasons(scored, recipe.scaling)
    reasons += more
    tokens = operands.get("tokens")
    # not seen (the layer did not run): judged by its features alone
    t = tokens if isinstance(tokens, int) else 16 * multiple(recipe)
    verdicts: dict[str, str] = {}
    for g in gemms(recipe, in_f, out_f, t, train):
        why = shape_problem(recipe, g)
        verdicts[g.name] = why or "ok"
        if why is None or in_f % multiple(recipe) or out_f % multiple(recipe):
            continue  # the features' rule is the filter's, said above
        dims = f"{g.mat1[0]}x{g.mat1[1]} @ {g.mat2[0]}x{g.mat2[1]}"
        if g.name == "grad_weight" and isinstance(tokens, int) and tokens % multiple(recipe):
            reasons.append(f"its {tokens} tokens (the weight gradient's reduction dim, {dims}) break it: {why}")
        else:
            reasons.append(f"its {g.name} GEMM ({dims}) breaks the float8 kernel's rule: {why}")
    flush = {w: v[SCORE[recipe.scaling]] for w, v in scored.items() if w in OPERANDS}
    return {
        "recipe": str(recipe),
        "flush_share": flush,
        "lost_share": lost,
        "gemm_lost_share": gemm_lost,
        "gemms": verdicts,
        "reasons": reasons,
    }


def filter_source(leave: list[str]) -> str:
    """A torchao ``module_filter_fn`` that converts every Linear but ``leave``."""
    return (
        "def module_filter_fn(mod, fqn):\n"
        f"    return isinstance(mod, torch.nn.Linear) and fqn not in {sorted(leave)!r}\n"
    )
