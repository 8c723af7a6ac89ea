"""`castwise explain` on an integer tensor made floating (issue 39): the real kernels' wordings,
produced here by running the ops on CPU, are read as a dtype error whose rule is CW116."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from castwise.diagnosis.explain import explain, render

_W = torch.randn(4, 2)
_I = torch.arange(4).float()  # an index made floating

OPS: dict[str, Callable[[], object]] = {
    "index": lambda: _W[_I],
    "embedding": lambda: F.embedding(_I, _W),
    "index_select": lambda: torch.index_select(_W, 0, _I),
    "gather": lambda: torch.gather(_W, 0, _I[:, None].expand(4, 2)),
    "scatter": lambda: torch.zeros(4, 2).scatter(0, _I[:, None].expand(4, 2), 1.0),
    "index_add": lambda: torch.zeros(4, 2).index_add_(0, _I, _W),
    "index_copy": lambda: torch.zeros(4, 2).index_copy_(0, _I, _W),
    "one_hot": lambda: F.one_hot(_I, 4),
}


def _real(op: str) -> BaseException:
    with pytest.raises((IndexError, RuntimeError)) as info:
        OPS[op]()
    return info.value


def _is_cw116(e: object) -> None:
    from castwise.diagnosis.explain import Explanation

    assert isinstance(e, Explanation)
    assert e.is_dtype_error and e.rule == "CW116", render(e)
    assert e.signal is not None and e.signal.startswith("index-dtype"), e.signal
    assert "integer tensor was made floating" in e.title
    assert any(".long()" in f for f in e.fixes) and any("is_floating_point" in f for f in e.fixes)
    text = render(e)
    assert "CW116 integer-tensor-made-floating" in text and "castwise rules CW116" in text


@pytest.mark.parametrize("op", list(OPS))
def test_the_real_cpu_wordings_read_as_an_integer_tensor_made_floating(op: str) -> None:
    error = _real(op)
    _is_cw116(explain(error))  # the exception, with its traceback
    _is_cw116(explain(f"{type(error).__name__}: {error}"))  # the pasted line


def test_the_cuda_embedding_wording_names_the_half_ids() -> None:
    e = explain(
        "RuntimeError: Expected tensor for argument #1 'indices' to have one of the following scalar types: "
        "Long, Int; but got torch.cuda.HalfTensor instead (while checking arguments for embedding)"
    )
    _is_cw116(e)
    assert e.dtypes == ("float16",) and "embedding" in (e.signal or "")


def test_the_older_wording_without_int_is_read_too() -> None:
    _is_cw116(explain("IndexError: tensors used as indices must be long, byte or bool tensors"))


def test_a_value_mismatch_of_an_index_op_is_still_the_strict_op() -> None:
    # index_put with a floating source: identical dtypes, not an index made floating
    e = explain(
        "RuntimeError: Index put requires the source and destination dtypes match, got Float for the "
        "destination and BFloat16 for the source."
    )
    assert e.rule != "CW116" and e.category == "STRICT_SAME_DTYPE_OP"


def test_diagnose_annotates_the_field_report_with_cw116_and_its_buffer() -> None:
    import castwise

    class Swin(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("relative_position_index", torch.arange(16).view(4, 4))
            self.table = torch.nn.Parameter(torch.randn(16, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.table[self.relative_position_index.view(-1)].sum()

    m = Swin()
    m.relative_position_index = m.relative_position_index.to(torch.bfloat16)
    with pytest.raises(IndexError, match="tensors used as indices") as info, castwise.diagnose():
        m(torch.randn(2, 4))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "relative_position_index" in notes and "CW116" in notes, notes
    assert "cause: an integer tensor was made floating (CW116" in notes and "Module.to()'s reach" not in notes
