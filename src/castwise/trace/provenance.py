"""Provenance: where a tensor's current dtype came from, as pure functions of an op.

Both producers call these: the dispatch-mode tracer per op it runs, the compiled producer's
graph walk per ATen node. The rule: an output keeps the origin of an operand of its dtype
(autocast's casts first, then parameters and buffers, then the rest in argument order; an empty
operand, a cache's start in a cat, last), else the op is where its dtype was made.

Where the two producers used to differ, each choice follows the real program:

- an empty operand carries no values, so an output never owes its dtype to it while another
  operand of that dtype exists (a KV cache's empty start in a ``cat``, eager or compiled);
- an op autocast manages names itself, not autocast's cast of its operands ("made by autocast in
  aten.mm", what the user wrote), in both producers: the cast node of a compiled graph is as
  much autocast's as the one the tracer sees;
- a cast is ``_to_copy`` or ``convert_element_type``: eager ``.to()`` dispatches the first, an
  Inductor-decomposed graph holds the second; ``aten.to`` never reaches either (it is
  CompositeImplicit), so it is not listed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from castwise._dtypes import fmt_tensor, name_of
from castwise.trace.events import Prov, shape_of

# which operand's origin an output keeps: autocast's casts, then weights, then the rest (2)
RANK = {"autocast": 0, "param": 1, "buffer": 1}
CASTS = frozenset({"aten._to_copy", "prims.convert_element_type"})


def _empty(t: torch.Tensor) -> bool:
    return any(type(n) is int and n == 0 for n in t.shape)


def kept(
    found: Sequence[tuple[Prov, torch.Tensor]],
    several: bool,
    op: str,
    module: str,
    out: torch.Tensor,
    *,
    cast: bool,
    forward: bool,
) -> Prov | None:
    """The origin ``out`` keeps from ``found``, the operands of its dtype that have one (in
    argument order); ``several``: the op has more than one tensor operand. None: none kept."""
    chosen: Prov | None = None
    rank = 9
    for p, t in found:
        r = RANK.get(p.kind, 2)
        if r == 2 and several and _empty(t):
            r = 3
        if r < rank:
            chosen, rank = p, r
            if r == 0:
                break
    if chosen is not None and rank == 0 and chosen.op in CASTS and not cast and chosen.module == module and forward:
        # autocast casts the operands of the op it manages: name that op, not the cast
        return Prov("autocast", module, op, fmt_tensor(name_of(out.dtype), shape_of(out)), out.dtype)
    return chosen


def made(
    op: str,
    module: str,
    out: torch.Tensor,
    operands: Sequence[tuple[Prov | None, torch.Tensor]],
    *,
    cast: bool,
    forward: bool,
    autocast: torch.dtype | None,
    line: Callable[[], str | None],
    hook: str | None = None,
) -> Prov:
    """The origin of ``out`` where ``op`` made its dtype (no operand of that dtype had one).
    ``line`` finds the user's line (called only for floating tensors made in forward);
    ``hook``: the user's forward hook running the op, if any."""
    dtype = out.dtype
    desc = fmt_tensor(name_of(dtype), shape_of(out))
    if not forward:
        return Prov("backward", module, op, desc, dtype)
    if cast and operands and autocast is not None:
        return Prov("autocast", module, op, desc, dtype)
    where = line() if out.is_floating_point() else None
    if hook is not None:
        op = f"{op} in forward hook {hook}"
    if not operands:
        return Prov("created", module, op, desc, dtype, where)
    if cast:
        return Prov("cast", module, op, desc, dtype, where)
    # type promotion of mixed operands: keep their origins (rare: only dtype-changing ops get here)
    mixed = tuple(p for p, t in operands if p is not None and t.is_floating_point() and t.dtype != dtype)
    return Prov("op", module, op, desc, dtype, where, promoted=mixed)


def replayed(module: str, out: torch.Tensor, *, forward: bool) -> Prov:
    """A tensor a reused block's record stands for, where the record kept no origin."""
    desc = fmt_tensor(name_of(out.dtype), shape_of(out))
    return Prov("op" if forward else "backward", module, None, desc, out.dtype)


def seeds(model: nn.Module) -> Iterator[tuple[torch.Tensor, Prov]]:
    """The model's own tensors' origins: parameters, buffers, plain tensor attributes (each
    tensor once, the first holder naming a buffer or an attribute)."""
    seen: set[int] = set()
    for p, prov in _params(model):
        seen.add(id(p))
        yield p, prov
    for mname, module in model.named_modules():
        dot = f"{mname}." if mname else ""
        for bname, b in module._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                yield b, Prov("buffer", mname, None, f"buffer {dot}{bname}", b.dtype)
        for aname, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not aname.startswith("_") and id(value) not in seen:
                seen.add(id(value))
                yield value, Prov("attribute", mname, None, f"tensor attribute {dot}{aname}", value.dtype)


def _params(model: nn.Module) -> Iterator[tuple[torch.Tensor, Prov]]:
    """Parameters' origins. A parameter shared by several modules (tied weights) is named after
    the last module that holds it, the one that ties itself to the first (an output head to its
    embedding, as ``tie_weights`` does), with every other holder listed."""
    owners: dict[int, list[tuple[str, str, torch.Tensor]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                entry = owners.setdefault(id(p), [])
                if all(m != mname for m, _n, _p in entry):
                    entry.append((mname, pname, p))
    for entry in owners.values():
        mname, pname, p = entry[-1]
        full = f"{mname}.{pname}" if mname else pname
        shared = [f"{m}.{n}" if m else n for m, n, _p in entry[:-1]]
        text = f"param {full}" + (f" (shared with {', '.join(shared)})" if shared else "")
        holders = tuple(dict.fromkeys(m for m, _n, _p in entry[:-1] if m != mname))
        yield p, Prov("param", mname, None, text, p.dtype, shared=holders)


def param(module: str, name: str, dtype: torch.dtype) -> Prov:
    """A parameter's origin where only its module and name are known (a layer's own dtype check)."""
    return Prov("param", module, None, f"param {module + '.' if module else ''}{name}", dtype)


def model_input(name: str, t: torch.Tensor) -> Prov:
    return Prov("input", "", None, f"model input `{name}`", t.dtype)


__all__ = ["CASTS", "RANK", "kept", "made", "model_input", "param", "replayed", "seeds"]
