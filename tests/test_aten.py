"""Ops looked up by name (castwise._aten): an op this torch lacks is left out, never an
AttributeError at import (torch 2.5 has no ``aten._grouped_mm``; docs/torch.md)."""

from __future__ import annotations

import torch

from castwise import _aten as aten


def test_an_op_this_torch_lacks_is_none_or_left_out() -> None:
    assert aten.op("add", "Tensor") is torch.ops.aten.add.Tensor
    assert aten.op("no_such_op_in_any_release") is None
    assert aten.op("add", "no_such_overload") is None
    assert aten.ops(["nonzero", "no_such_op_in_any_release"]) == [torch.ops.aten.nonzero.default]


def test_overloads_leave_out_the_out_variants_when_asked() -> None:
    every = aten.overloads(["nonzero", "no_such_op_in_any_release"])
    kept = aten.overloads(["nonzero"], out=False)
    assert torch.ops.aten.nonzero.out in every
    assert torch.ops.aten.nonzero.default in kept and torch.ops.aten.nonzero.out not in kept
