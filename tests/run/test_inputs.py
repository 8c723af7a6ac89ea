"""castwise.run.Inputs: one rule for what the inputs mean, one pytree walk for every conversion."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from castwise.applied import cast_floating
from castwise.run import Inputs, map_tensors, tensors_of
from castwise.run.inputs import split

Batch = collections.namedtuple("Batch", "x y")


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def _model_output() -> Any:
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=torch.ones(2), attentions=(torch.ones(1),))


class Sig(nn.Module):
    def forward(self, x: Any, batch: Any = None, *rest: Any, **kw: Any) -> Any:
        return x


T = torch.ones(2)


@pytest.mark.parametrize(
    ("inputs", "args", "kwargs"),
    [
        (T, (T,), {}),
        ((T, T), (T, T), {}),
        ([T, T], (T, T), {}),
        ({"x": T}, (), {"x": T}),
        (collections.OrderedDict(x=T), (), {"x": T}),
    ],
    ids=["tensor", "tuple", "list", "dict", "ordereddict"],
)
def test_dicts_are_keywords_plain_tuples_positions(inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    got_args, got_kwargs = split(inputs)
    assert len(got_args) == len(args) and all(a is b for a, b in zip(got_args, args, strict=True))
    assert got_kwargs.keys() == kwargs.keys()


@pytest.mark.parametrize(
    "build", [lambda: Batch(T, T), lambda: Pair(T, T), _model_output], ids=["namedtuple", "dataclass", "modeloutput"]
)
def test_any_other_object_is_one_argument(build: Any) -> None:
    obj = build()
    inputs = Inputs.of(obj)
    assert inputs.args == (obj,) and inputs.kwargs == {}
    assert inputs.call(lambda *a, **k: (a, k)) == ((obj,), {})


def test_each_tensor_is_named_once_from_the_signature() -> None:
    ids, mask, extra = torch.ones(1), torch.ones(2), torch.ones(3)
    inputs = Inputs.of(((ids, [mask]), {"ids": ids}, 3, extra))
    assert [n for n, _t in inputs.named(Sig())] == ["x[0]", "x[1][0]", "batch['ids']", "arg3"]
    assert [n for n, _t in Inputs.of({"x": ids, "batch": {"m": mask}}).named(Sig())] == ["x", "batch['m']"]
    assert [n for n, _t in Inputs.of(Batch(ids, mask)).named(Sig())] == ["x[0]", "x[1]"]
    assert [n for n, _t in Inputs.of(_model_output()).named(Sig())] == ["x['last_hidden_state']", "x['attentions'][0]"]


def test_conversions_rebuild_each_node_as_its_own_type() -> None:
    half = Batch(torch.ones(2, dtype=torch.bfloat16, requires_grad=True), {"m": torch.ones(1, dtype=torch.float16)})
    wide = Inputs.of(half).widen()
    (arg,) = wide.args
    assert type(arg) is Batch and arg.x.dtype == torch.float32 and arg.x.requires_grad
    assert arg.y["m"].dtype == torch.float32 and half.x.dtype == torch.bfloat16
    out = Inputs.of(_model_output()).map(lambda t: t * 2).args[0]
    assert type(out).__name__ == "BaseModelOutput" and float(out.attentions[0]) == 2.0


def test_real_copies_are_clones_the_model_cannot_write_through() -> None:
    x = torch.zeros(2)
    real = Inputs.of({"x": x}).real()
    real.kwargs["x"].add_(1)
    assert float(x.sum()) == 0.0 and real.tensors()[0] is real.kwargs["x"]


def test_fake_copies_keep_shared_tensors_shared() -> None:
    x = torch.randn(2, 3)
    memo: dict[int, torch.Tensor] = {}
    fake = Inputs.of((x, [x])).fake(FakeTensorMode(allow_non_fake_inputs=True), "cpu", memo)
    first, (second,) = fake.args
    assert isinstance(first, FakeTensor) and first is second and memo[id(x)] is first


def test_model_outputs_of_diffusers_rebuild_without_a_hand_written_walker() -> None:
    from diffusers.models.autoencoders.vae import DecoderOutput

    out = DecoderOutput(sample=torch.ones(1, dtype=torch.bfloat16))
    assert map_tensors(out, torch.Tensor.float).sample.dtype == torch.float32
    assert cast_floating(out, torch.float16).sample.dtype == torch.float16
    assert [t.dtype for t in tensors_of(out)] == [torch.bfloat16]
