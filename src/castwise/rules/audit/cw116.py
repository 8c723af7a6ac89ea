"""CW116 integer-tensor-made-floating: An op that needs integer (or bool) indices got a tensor made floating."""

from __future__ import annotations

from castwise._dtypes import name_of, short_of
from castwise.rules._rule import Rule
from castwise.rules.api import Ctx, ProvLike
from castwise.rules.audit._base import AuditRule, Check, Diag
from castwise.rules.audit._text import where

META = Rule(
    code="CW116",
    name="integer-tensor-made-floating",
    category="UNCONVERTED_TENSOR_OR_BUFFER",
    severity="error",
    summary="An op that needs integer (or bool) indices got a tensor made floating.",
    detects=(
        "Indexing, index_select, gather/scatter, embedding ids, masked_fill or where receive a "
        "floating tensor where the kernel takes integers (or bools), and the tensor became floating "
        "in the model: a cast (`.to(bf16)`, `.half()`, `.float()`, `type_as`), a buffer cast with the "
        "weights (a loader, a hand cast of every buffer), a factory or `/` that made floats, or integer "
        "data given to the model as floats; or an int32 index where the op takes int64 only (one_hot)."
    ),
    why=(
        "`model.to(dtype)` casts floating tensors only, but a hand-written cast of every buffer (or "
        "`load_state_dict(..., assign=True)` from a half checkpoint) turns an index buffer such as "
        "Swin's relative_position_index into bf16: 'tensors used as indices must be long, int, byte "
        "or bool tensors'. Casting the index to the other operand's dtype does not help."
    ),
    example=(
        "for name, b in model.named_buffers():  # a loader casting every buffer\n"
        "    b.data = b.data.to(torch.bfloat16)  # relative_position_index becomes bf16\n"
        "table[self.relative_position_index.view(-1)]  # IndexError"
    ),
    fix=(
        "Keep the tensor integral: cast only floating buffers (as `model.to(dtype)` does), make index "
        "buffers non-persistent and recompute them, or `.long()` at the use."
    ),
)

_INTEGRAL = frozenset({"int64", "int32", "int16", "int8", "uint8", "bool"})


def _became(first: ProvLike, dt: str) -> tuple[str, str] | None:
    """How the tensor became floating, and the fix for that way; None: the provenance does not show it."""
    line = f" ({first.source})" if first.source else ""
    op = f" {first.op}" if first.op else ""
    at = where(first.module)
    if first.kind in ("cast", "autocast"):
        return (
            f"cast to {dt} by{op} in {at}{line}",
            f"drop the cast of the index{line}; a float cast (`.to(dtype)`, `.half()`, `.float()`, `type_as`) "
            "never belongs on an index",
        )
    if first.kind in ("buffer", "param", "attribute"):
        return (
            f"{first.tensor} is {dt}: a cast of the model's tensors reached an integer one (a loader or a "
            "hand cast of every buffer; `model.to(dtype)` leaves integer buffers alone)",
            "cast only floating buffers (`if b.is_floating_point()`), or register the index as a "
            "non-persistent buffer (`persistent=False`) recomputed in `__init__`, never loaded",
        )
    if first.kind == "created":
        return (
            f"created as {dt} by{op} in {at}{line}: a float tensor made where an integer one was meant",
            "create it integral (`dtype=torch.long`, `torch.arange(n)` with integer bounds)",
        )
    if first.kind == "op":
        return (
            f"made {dt} by{op} in {at}{line} (true division `/` or a float operand makes floats)",
            "keep the arithmetic integral (`//`, integer operands)",
        )
    if first.kind == "input":
        return (
            f"{first.tensor} is {dt}: integer data given as floats (a batch cast to the model's dtype, or built "
            "as floats)",
            "pass it as int64, and cast only the floating inputs (`v.to(dtype) if v.is_floating_point() else v`)",
        )
    return None  # made in backward: the forward's finding says where


def _narrow(ctx: Ctx, first: ProvLike) -> Diag:
    """An integer index of another width where the op takes int64 only (one_hot): int32 labels."""
    dt = short_of(first.dtype)
    line = f" ({first.source})" if first.source else ""
    how = (
        f"cast to {dt} by {first.op} in {where(first.module)}{line}"
        if first.kind in ("cast", "autocast")
        else f"from {first.describe()}"
    )
    drop = f"; drop the narrowing cast{line}" if first.kind == "cast" else ""
    return ctx.diag(
        "CW116",
        f"{ctx.at} needs integer indices (int64) and got {dt}, {how}: this op takes int64 only. Real error: {ctx.text}",
        f"`.long()` the index where it is made or at the use{drop} (int32 labels from a dataset or a `.int()` cast "
        "are refused here).",
    )


def _match(ctx: Ctx) -> Diag | None:
    first = ctx.first
    if first is None or ctx.expected not in _INTEGRAL:
        return None
    if ctx.expected == "int64" and name_of(first.dtype) in _INTEGRAL - {"int64", "bool"}:
        return _narrow(ctx, first)
    if not (first.dtype.is_floating_point or first.dtype.is_complex):
        return None
    dt = short_of(first.dtype)
    # a model input has its own rules where one speaks for it: CW108 (masks), CW110.embedding (ids)
    own = first.kind == "input" and (ctx.kind == "mask" or "embedding" in (ctx.op or ""))
    became = None if own else _became(first, dt)
    if became is None:
        return None
    what, fix = became
    boolean = ctx.expected == "bool"
    # one_hot's own check takes int64 only ("index tensor of type LongTensor")
    ints = "int64" if "LongTensor" in ctx.text else "int64 or int32"
    needs = "a boolean mask" if boolean else f"integer indices ({ints})"
    use = "`.bool()`" if boolean else "`.long()`"
    return ctx.diag(
        "CW116",
        f"{ctx.at} needs {needs} and got {dt}, {what}. Real error: {ctx.text}",
        f"Keep the tensor integral: {fix}; or {use} at the use. Casting the index to the other operand's dtype "
        "does not help.",
    )


RULE = AuditRule(META, checks=(Check("CW116", _match),))
