"""Provenance is one rule (``trace/provenance.py``): the eager producer (the dispatch-mode tracer)
and the compiled producer (the graph walk over AOTAutograd's graphs) give the same ``Prov``
records for the same program, field by field, where the two used to differ (an empty operand,
the op autocast manages, a decomposed cast) and where they did not (casts, promotion, tied and
buffered weights, a refused op's operands)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from contextlib import nullcontext, suppress
from typing import Any

import pytest
import torch
from torch import nn
from torch._inductor.decomposition import select_decomp_table

from castwise import _autocast
from castwise._compiled import CompileOptions
from castwise.devices import get as get_device
from castwise.trace import fake as fake_mod
from castwise.trace import provenance
from castwise.trace.compiled import CompiledProducer, warm_up
from castwise.trace.events import Event, Prov
from castwise.trace.tracer import Tracer, traced

BF16 = torch.bfloat16


class Cast(nn.Module):
    """A user's cast, then a bf16 layer: its output keeps its bias's origin (a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).to(BF16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x.to(BF16)
        return h, self.lin(h), h * 2


class Autocast(nn.Module):
    """A float32 layer under autocast: its output is autocast's, named after the matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.lin(x),)


class Cache(nn.Module):
    """A KV cache's empty start in a cat: the output owes its dtype to the other operand."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        start = torch.zeros(2, 0)
        return (torch.cat([start, x * 2], dim=1),)


class Promote(nn.Module):
    """f16 + bf16 promotes to f32: the op is the origin and keeps its operands' origins."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.half() + x.bfloat16(),)


class Tied(nn.Module):
    """A head tied to its embedding, and a buffer: both named as the tracer always named them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.embed(ids) * self.scale
        return h, self.head(h)


class Refused(nn.Module):
    """A bf16 activation meets a float32 weight: the refused matmul's operands' origins."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.lin(x.to(BF16)),)


def _floats() -> torch.Tensor:
    return torch.randn(2, 4)


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 2, 3]])


def _eager(model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None) -> tuple[list[Prov | None], list[Event]]:
    fmode = fake_mod.new_mode()
    copy = fake_mod.fake_model(model, fmode, "cpu")
    fx = fake_mod.fake_input(x, fmode, "cpu", {})
    tracer = Tracer(copy, "cpu", fake=True, inputs=[("x", fx)])
    tracer.at.root_autocast = autocast
    outs: Any = ()
    autocasting = _autocast.autocast("cpu", autocast) if autocast is not None else nullcontext()
    # a refused op raises: its event holds what is compared
    with fmode, traced(tracer), torch.no_grad(), autocasting, suppress(RuntimeError):
        outs = copy(fx)
    return [tracer.prov_of(o) for o in outs], list(tracer.trace.events)


def _compiled(
    model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None, backend: str
) -> tuple[list[Prov | None], list[Event]]:
    warm_up()
    fmode = fake_mod.new_mode()
    copy = fake_mod.fake_model(model, fmode, "cpu")
    fx = fake_mod.fake_input(x, fmode, "cpu", {})
    producer = CompiledProducer(copy, get_device("cpu"), autocast, record_ops=True)
    producer.seed_inputs([("x", fx)])
    if CompileOptions(backend=backend).inductor:  # the graphs Inductor lowers: casts decomposed
        producer.decompositions = select_decomp_table()
    # torch.compile itself: Lightning Fabric, once imported, wraps it and deep-copies the backend
    compiled = inspect.unwrap(torch.compile)(copy, backend=producer.backend)
    outs: Any = ()
    with fmode, torch.no_grad(), _autocast.autocast("cpu", autocast) if autocast is not None else nullcontext():
        outs = compiled(fx)
    torch._dynamo.reset()
    return [producer.prov_of(o) for o in outs], list(producer.trace.events)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], torch.dtype | None]] = {
    "cast": (Cast, _floats, None),
    "autocast": (Autocast, _floats, BF16),
    "empty operand": (Cache, _floats, None),
    "promotion": (Promote, _floats, None),
    "tied and buffered weights": (Tied, _ids, None),
    "refused": (Refused, _floats, None),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(CASES))
def test_eager_and_compiled_producers_give_the_same_provenance(case: str, backend: str) -> None:
    make, inputs, autocast = CASES[case]
    torch.manual_seed(0)
    model = make()
    x = inputs()
    eager, eager_events = _eager(model, x, autocast)
    compiled, compiled_events = _compiled(model, x, autocast, backend)
    assert eager and all(p is not None for p in eager)
    assert [_as_eager(p) for p in compiled] == eager
    assert [tuple(map(_as_eager, e.provs)) for e in compiled_events] == [e.provs for e in eager_events]


def _as_eager(p: Prov | None) -> Prov | None:
    """A compiled record names the ops its graph ran: Inductor's decomposed cast is the
    ``_to_copy`` the eager program dispatched; every other field is the same."""
    if p is None:
        return None
    op = "aten._to_copy" if p.op == "prims.convert_element_type" else p.op
    return dataclasses.replace(p, op=op, promoted=tuple(q for q in map(_as_eager, p.promoted) if q is not None))


def test_the_rule_where_the_producers_used_to_differ() -> None:
    """What each producer now says of the three details they disagreed on."""
    torch.manual_seed(0)
    (auto,), _ = _eager(Autocast(), _floats(), BF16)
    assert auto is not None and (auto.kind, auto.module, auto.op) == ("autocast", "lin", "aten.mm")
    (cat,), _ = _eager(Cache(), _floats(), None)
    assert cat is not None and (cat.kind, cat.tensor) == ("input", "model input `x`")
    assert {"aten._to_copy", "prims.convert_element_type"} == provenance.CASTS
    _, (refused,) = _eager(Refused(), _floats(), None)
    cast, weight = refused.provs[0], refused.provs[-1]
    assert cast is not None and (cast.kind, cast.op) == ("cast", "aten._to_copy")
    line = inspect.getsourcelines(Refused.forward)[1] + 1
    assert cast.source is not None and cast.source.endswith(f"test_provenance.py:{line}")
    assert weight is not None and (weight.kind, weight.tensor) == ("param", "param lin.weight")


def test_tied_parameters_are_named_after_their_last_holder() -> None:
    found = [p.tensor for _t, p in provenance.seeds(Tied())]
    assert found == ["param head.weight (shared with embed.weight)", "buffer scale"]
