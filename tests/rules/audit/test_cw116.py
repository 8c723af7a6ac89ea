"""CW116 on the field report of issue 39 (Swin's relative_position_index cast to bf16 by a loader)
and its look-alikes. Every expectation is held against the real CPU run of the same model: where
CW116 is reported the real run raises the very error the finding quotes; the controls run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import castwise

HERE = Path(__file__).name


class _Swin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("relative_position_index", torch.arange(16).view(4, 4))
        self.table = nn.Parameter(torch.randn(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[self.relative_position_index.view(-1)].sum()


def _real_error(model: nn.Module, *inputs: torch.Tensor) -> str | None:
    try:
        model(*inputs)
    except (IndexError, RuntimeError) as e:
        return str(e).splitlines()[0]
    return None


def _cw116(model: nn.Module, *inputs: torch.Tensor, policy: str | None = None) -> castwise.Finding:
    real = _real_error(model, *inputs)
    report = castwise.audit(model, inputs, policy=policy, mode="eval")
    assert [f.code for f in report.errors] == ["CW116"], str(report)
    f = report.errors[0]
    assert real is not None and real in f.message, (real, f.message)  # the real kernel's words
    return f


def test_the_field_report_names_the_buffer_the_real_error_and_keeps_the_index_integral() -> None:
    m = _Swin()
    m.relative_position_index = m.relative_position_index.to(torch.bfloat16)
    f = _cw116(m, torch.randn(2, 4))
    assert f.module == "" and f.op == "aten.index"
    assert f.origin is not None and "relative_position_index" in (f.origin.tensor or "")
    assert "tensors used as indices must be long, int, byte or bool tensors" in f.message
    assert "identical dtypes" not in f.message and "integer indices" in f.message
    fix = f.fix or ""
    assert ".long()" in fix and "floating buffers" in fix and "persistent=False" in fix
    assert "src.to(dst.dtype)" not in fix


def test_a_checkpoint_loaded_with_assign_makes_the_buffer_floating_a_plain_load_does_not() -> None:
    half = {k: v.to(torch.bfloat16) for k, v in _Swin().state_dict().items()}
    copied = _Swin()
    copied.load_state_dict(half)  # copy_ into the int64 buffer: it stays int64
    assert copied.relative_position_index.dtype == torch.int64
    assert _real_error(copied, torch.randn(2, 4)) is None
    assert castwise.audit(copied, torch.randn(2, 4), mode="eval").errors == []
    assigned = _Swin()
    assigned.load_state_dict(half, assign=True)  # the checkpoint's bf16 tensor replaces the buffer
    f = _cw116(assigned, torch.randn(2, 4))
    assert f.origin is not None and "relative_position_index" in (f.origin.tensor or "")


class _CastIndex(nn.Module):
    def __init__(self, cast: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.cast = cast
        self.register_buffer("idx", torch.arange(4))
        self.table = nn.Parameter(torch.randn(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = self.cast(self.idx, x)
        return x + self.table[i].sum()


# the user's line a finding names is the line of the cast itself (here, each lambda's)
CASTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "to-bf16": lambda i, x: i.to(torch.bfloat16),
    "half": lambda i, x: i.half(),
    "float": lambda i, x: i.float(),
    "type_as": lambda i, x: i.type_as(x),
}


@pytest.mark.parametrize("name", list(CASTS))
def test_a_cast_in_forward_is_the_origin_with_the_users_line(name: str) -> None:
    f = _cw116(_CastIndex(CASTS[name]), torch.randn(2, 4))
    line = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if f'"{name}": lambda' in text)
    assert (f.source or "").endswith(f"{HERE}:{line}"), f.source
    assert f.origin is not None and f.origin.op == "aten._to_copy"
    assert "cast to" in f.message and "drop the cast" in (f.fix or "")


class _Op(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.emb = nn.Embedding(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = torch.arange(4).float()
        w = self.emb.weight
        if self.op == "index_select":
            return x + torch.index_select(w, 0, i).sum()
        if self.op == "gather":
            return x + torch.gather(w, 0, i[:, None].expand(4, 2)).sum()
        if self.op == "scatter":
            return x.scatter(1, torch.zeros(2, 1).to(torch.bfloat16), 1.0)
        if self.op == "embedding":
            return x + self.emb(i).sum()
        if self.op == "masked_fill":
            return x.masked_fill((x > 0).float(), 0.0)
        if self.op == "where":
            return torch.where((x > 0).float(), x, 0.0)
        if self.op == "div":
            return x + w[torch.arange(4) / 2].sum()  # true division makes floats
        return x + w[torch.zeros(4)].sum()  # a float factory where indices were meant


@pytest.mark.parametrize(
    "op", ["index_select", "gather", "scatter", "embedding", "masked_fill", "where", "div", "created"]
)
def test_every_op_that_needs_integers_or_bools_reports_cw116(op: str) -> None:
    f = _cw116(_Op(op), torch.randn(2, 4))
    boolean = op in ("masked_fill", "where")
    assert ("a boolean mask" if boolean else "integer indices") in f.message
    assert (".bool()" if boolean else ".long()") in (f.fix or "")
    if op == "div":
        assert "`//`" in (f.fix or "")
    if op == "created":
        assert "created as f32" in f.message


# -- look-alikes that must stay clean (each runs for real) -------------------------------------------


class _Controls(nn.Module):
    def __init__(self, which: str) -> None:
        super().__init__()
        self.which = which
        self.register_buffer("idx", torch.arange(4))
        self.table = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.which == "long":
            return x + self.table[self.idx.to(torch.bfloat16).long()].sum()
        mask = (x > 0).float()
        return torch.where(mask.bool(), x, 0.0)


@pytest.mark.parametrize("which", ["long", "bool"])
def test_an_index_made_integral_again_before_use_is_clean(which: str) -> None:
    model, x = _Controls(which), torch.randn(2, 4)
    assert _real_error(model, x) is None
    assert castwise.audit(model, x, mode="eval").findings == []


def test_model_to_bf16_and_a_true_policy_leave_integer_buffers_integer() -> None:
    model = _Swin().to(torch.bfloat16)
    assert model.relative_position_index.dtype == torch.int64  # Module.to casts floating tensors only
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert _real_error(model, x) is None
    assert castwise.audit(model, x, mode="eval").errors == []
    plain = _Swin()
    with castwise.apply(plain, "bf16-true"):
        assert plain.relative_position_index.dtype == torch.int64 and plain.table.dtype == torch.bfloat16
        assert _real_error(plain, torch.randn(2, 4, dtype=torch.bfloat16)) is None
    assert castwise.audit(_Swin(), torch.randn(2, 4), policy="bf16-true", mode="eval").errors == []


class _Gather(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 2))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x + self.table[idx].sum()


def test_a_float_index_given_as_a_model_input_says_pass_integers_not_cast_the_source() -> None:
    f = _cw116(_Gather(), torch.randn(2, 4), torch.tensor([1.0, 2.0]))
    assert f.origin is not None and "model input `idx`" in (f.origin.tensor or "")
    assert "integer data given as floats" in f.message and "int64" in (f.fix or "")


def test_float_ids_given_as_a_model_input_stay_with_the_embedding_rule() -> None:
    # no place in the model made them floating: CW110's "pass int64 ids" (no cast to drop)
    model = nn.Sequential(nn.Embedding(10, 4))
    ids = torch.tensor([[1.0, 2.0]])
    assert _real_error(model, ids) is not None
    report = castwise.audit(model, ids, mode="eval")
    assert [f.code for f in report.errors] == ["CW110"], str(report)


class _OneHot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return (h * nn.functional.one_hot(labels, 4).to(h.dtype)).sum()


@pytest.mark.parametrize("make", [lambda t: t.to(torch.bfloat16), lambda t: t / 1], ids=["cast", "true_division"])
def test_one_hots_own_index_check_names_the_index_not_the_activations(
    make: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    # one_hot checks its index before any op dispatches: the raising line reads the activations
    # too, but the tensor it names is the one given to one_hot
    f = _cw116(_OneHot(), torch.randn(8, 4), make(torch.randint(0, 4, (8,))))
    assert f.origin is not None and f.origin.tensor is not None and "labels" in f.origin.tensor
    assert "only applicable to index tensor" in f.message and "(int64)" in f.message


def test_int64_labels_for_one_hot_are_clean() -> None:
    m = _OneHot()
    labels = torch.randint(0, 4, (8,))
    assert _real_error(m, torch.randn(8, 4), labels) is None
    assert not castwise.audit(m, (torch.randn(8, 4), labels), mode="eval").findings


class _OneHotInt(_OneHot):
    """one_hot of labels cast to int32 on the calling line (the index is an expression, not a name)."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return (h * nn.functional.one_hot(labels.int(), 4).to(h.dtype)).sum()


def test_int32_labels_given_to_one_hot_are_the_index_rule_not_a_contract_clash() -> None:
    # issue 39: int32 labels (a dataset's dtype) reach one_hot, which takes int64 only
    labels = torch.randint(0, 4, (8,), dtype=torch.int32)
    f = _cw116(_OneHot(), torch.randn(8, 4), labels)
    assert f.origin is not None and f.origin.tensor is not None and "labels" in f.origin.tensor
    assert "(int64)" in f.message and "got i32" in f.message and "mixed dtypes" not in f.message
    assert ".long()" in (f.fix or "") and "floating buffers" not in (f.fix or "")


def test_an_int32_cast_inside_the_one_hot_call_is_the_culprit_not_a_weight() -> None:
    f = _cw116(_OneHotInt(), torch.randn(8, 4), torch.randint(0, 4, (8,)))
    assert f.origin is not None and "proj" not in (f.origin.tensor or "") and "aten._to_copy" in (f.origin.op or "")
    assert "(int64)" in f.message and "got i32" in f.message and "drop the narrowing cast" in (f.fix or "")


class _Take(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 4))

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.table[labels].sum() + self.table.index_select(0, labels).sum()


def test_int32_indices_where_the_kernel_takes_them_are_clean() -> None:
    # look-alike of the one_hot case: indexing and index_select take int32 as well as int64
    labels = torch.randint(0, 4, (8,), dtype=torch.int32)
    assert _real_error(_Take(), labels) is None
    assert not castwise.audit(_Take(), labels, mode="eval").findings


class _Router(nn.Module):
    """A MoE router counting tokens per expert with bincount (ids cast with the activations, or not)."""

    def __init__(self, cast_ids: bool, ids: torch.dtype = torch.int64, weighted: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.cast_ids, self.ids, self.weighted = cast_ids, ids, weighted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        idx = logits.argmax(-1).to(self.ids)
        if self.cast_ids:
            idx = idx.to(logits.dtype)
        w = logits.max(-1).values if self.weighted else None
        return logits.sum() + torch.bincount(idx, weights=w, minlength=4).to(logits.dtype).sum()


def _router_real_error(make: Callable[[], _Router], policy: str | None) -> str | None:
    real = make()
    if policy:
        castwise.apply(real, policy)  # the real run under the same policy, in place
    return _real_error(real, torch.randn(16, 8))


@pytest.mark.parametrize("policy", [None, "bf16-true"])
def test_bincount_of_ids_cast_with_the_activations_is_the_index_rule(policy: str | None) -> None:
    # bincount's contract (trace/contracts/index.py): integer ids only; it was unchecked (CW901) and
    # the fake kernel's refusal ended the run as "incomplete" (CW902)
    real = _router_real_error(lambda: _Router(cast_ids=True), policy)
    report = castwise.audit(_Router(cast_ids=True), torch.randn(16, 8), policy=policy, mode="eval")
    assert [x.code for x in report.errors] == ["CW116"], str(report)
    assert not [x for x in report.findings if x.code in ("CW901", "CW902")], str(report)
    f = report.errors[0]
    assert f.op == "aten.bincount" and "drop the cast of the index" in (f.fix or "")
    assert real is not None and real in f.message


@pytest.mark.parametrize(
    "make",
    [lambda: _Router(False), lambda: _Router(False, torch.int32), lambda: _Router(False, torch.uint8, weighted=True)],
    ids=["i64", "i32", "u8-weighted"],
)
@pytest.mark.parametrize("policy", [None, "bf16-true"])
def test_bincount_of_integer_ids_is_checked_and_clean(make: Callable[[], _Router], policy: str | None) -> None:
    assert _router_real_error(make, policy) is None
    codes = {f.code for f in castwise.audit(make(), torch.randn(16, 8), policy=policy, mode="eval").findings}
    assert codes <= {"CW903"}, codes  # the ids' values are assumed; the op itself is checked (no CW901)
