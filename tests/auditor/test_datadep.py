"""Sizes from values on fake tensors (trace/datadep.py): the fake run goes on past ``x[mask]``,
masked writes (``index_put``), ``nonzero``, ``masked_select``, ``repeat_interleave``, ``unique``
and ``.item()`` numbers, and its verdict equals the real CPU run's, mode by mode.

Each module here is built twice: clean, and with a dtype fault at or after the data-dependent op
(where an audit that stopped at it would say nothing). The real run is the plain model on real
CPU tensors: train (forward + backward of a float32 sum) and eval (no_grad)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import transformers
from torch import nn

import castwise
from castwise.report import Report

MODES = ("train", "eval")


def _real_raises(model: nn.Module, x: torch.Tensor, mode: str) -> bool:
    """The plain real CPU run raises a dtype error (any other error fails the test: it would
    mean the module itself is wrong)."""
    try:
        if mode == "train":
            model.train()
            model(x).float().sum().backward()
        else:
            model.eval()
            with torch.no_grad():
                model(x)
    except RuntimeError as exc:
        text = str(exc)
        assert "dtype" in text or "Double" in text or "type" in text, text
        return True
    return False


def _fake_verdict(report: Report, mode: str) -> bool:
    return any(mode in f.modes for f in report.errors)


class _Base(nn.Module):
    """An activation with no values on fake tensors feeds the data-dependent op; ``bad`` makes the
    operand after it float64, which the real kernel refuses next to float32."""

    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.odd = torch.float64 if bad else torch.float32


class MaskedRead(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        picked = h[h.sum(-1) > 0]  # rows chosen by value
        out: torch.Tensor = self.head(picked.to(self.odd)).sum() + h.sum()
        return out


class MaskedRead2d(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).view(2, 8, 8)
        picked = h[h.sum(-1) > 0]  # a 2-d mask over (batch, position)
        out: torch.Tensor = self.head(picked.to(self.odd)).sum()
        return out


class MaskedWrite(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).clone()
        mask = h > 0.1
        h[mask] = (h.detach()[mask] * 0.5).to(self.odd)  # index_put_: the source must match
        out: torch.Tensor = self.head(h)
        return out


class AccumulateWrite(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        idx = (h[:, 0] > 0).nonzero().squeeze(1)
        summed = torch.zeros_like(h).index_put((idx,), h[idx].to(self.odd), accumulate=True)
        out: torch.Tensor = self.head(summed)
        return out


class ItemSize(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        n = int((h > 0).sum().item())  # a size read from values
        pad = torch.ones(n, 8, dtype=self.odd)
        out: torch.Tensor = self.head(pad).sum() + h.sum()
        return out


class MaskedSelect(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        v = torch.masked_select(h, h > 0)
        out: torch.Tensor = self.head(v[: v.numel() // 8 * 8].view(-1, 8).to(self.odd)).sum() + h.sum()
        return out


class RepeatRows(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        reps = (h > 0).long().sum(-1)  # each row repeated as often as it has positive entries
        out: torch.Tensor = self.head(h.repeat_interleave(reps, dim=0).to(self.odd)).sum()
        return out


class UniqueIds(_Base):
    def __init__(self, bad: bool) -> None:
        super().__init__(bad)
        self.emb = nn.Embedding(10, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        ids = torch.unique((h.detach().abs() * 3).long().clamp(0, 9))
        out: torch.Tensor = self.head(self.emb(ids).to(self.odd)).sum() + h.sum()
        return out


class SplitByCounts(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        mask = h > 0
        counts = mask.sum(0).tolist()  # read before the mask is used: both must agree
        parts = torch.split(h.t()[mask.t()], counts)
        out: torch.Tensor = sum((self.head(p.repeat(8, 1).t().to(self.odd)).sum() for p in parts), h.sum())
        return out


class Bincount(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        load = torch.bincount(h.argmax(-1), minlength=8)  # tokens per expert, as MoE routers count
        out: torch.Tensor = self.head(load.to(self.odd)[None]).sum() + h.sum()
        return out


CASES: list[Callable[[bool], nn.Module]] = [
    MaskedRead,
    MaskedRead2d,
    MaskedWrite,
    AccumulateWrite,
    ItemSize,
    MaskedSelect,
    RepeatRows,
    UniqueIds,
    SplitByCounts,
    Bincount,
]


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "fault"])
@pytest.mark.parametrize("make", CASES, ids=lambda c: c.__name__)
def test_fake_audit_goes_past_the_data_dependent_op_and_agrees_with_the_real_run(
    make: Callable[[bool], nn.Module], bad: bool
) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    report = castwise.audit(make(bad), x)
    assert [r.status for r in report.runs] != ["incomplete"] * 2, str(report)
    assert not report.incomplete, str(report)
    for mode in MODES:
        torch.manual_seed(0)
        real = _real_raises(make(bad), x, mode)
        assert real == bad, f"the {mode} module does not do what it is for (real raised: {real})"
        assert _fake_verdict(report, mode) == real, f"{mode}: real raised {real}\n{report}"
    assert report.ok == (not bad)


def test_the_masked_write_is_reported_with_the_module_that_made_the_f32_source() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # bf16: most of the model
            self.src = nn.Linear(8, 8)  # left f32 in a bf16 model: it makes the source

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x).clone()
            mask = h > 0
            h[mask] = self.src(x.float())[mask]
            out: torch.Tensor = h
            return out

    model = Block().to(torch.bfloat16)
    model.src.float()
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Index put requires the source and destination dtypes match"):
        model(x)
    report = castwise.audit(model, x, mode="eval")
    (err,) = report.errors
    assert err.op == "aten.index_put_" and "Index put requires" in err.message, str(report)
    assert err.origin is not None and err.origin.module == "src", str(report)
    cw903 = next(f for f in report.findings if f.code == "CW903")
    assumed = dict(cw903.details)["assumed_sizes"]
    assert {a["assumed"] for a in assumed} == {"a mask with unknown values taken as all True"}


def test_a_mask_made_from_known_values_sizes_exactly_and_assumes_nothing() -> None:
    class Pick(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.lin(x[keep > 0])  # keep is an input: its values are known
            return out

    x, keep = torch.randn(6, 4), torch.tensor([1, 0, 1, 1, 0, 0])
    report = castwise.audit(Pick(), (x, keep), mode="eval")
    assert report.findings == [] and report.ok, str(report)


def test_sizes_agree_between_a_mask_and_the_count_read_from_it() -> None:
    """The count is read before the mask is used: both come from one assumption (all True)."""

    class Count(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            mask = h[:, 0] > 0
            n = int(mask.sum().item())
            out: torch.Tensor = h[mask].view(n, 4) + h[~mask].sum()  # a wrong count would fail the view
            return out

    report = castwise.audit(Count(), torch.randn(5, 4))
    assert report.ok and [r.status for r in report.runs] == ["ok", "ok"], str(report)


def _wav2vec2(fault: bool) -> tuple[nn.Module, torch.Tensor]:
    warnings.filterwarnings("ignore", module="transformers")
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(  # type: ignore[call-arg]
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(8, 8),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_feat_extract_layers=2,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.5,  # training masks time steps: hidden[mask] = masked_spec_embed
        mask_time_length=2,
    )
    model: nn.Module = transformers.Wav2Vec2Model(cfg)
    model.to(torch.bfloat16)
    if fault:
        # after the masked write: an audit that stopped there misses it
        model.get_submodule("encoder.layers.1.feed_forward").float()
    return model, torch.randn(2, 400, dtype=torch.bfloat16)


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "fault"])
def test_wav2vec2_masked_time_steps_audit_to_the_end_like_the_real_cpu_run(fault: bool) -> None:
    model, x = _wav2vec2(fault)
    report = castwise.audit(model, {"input_values": x})
    assert [r.status for r in report.runs] == (["error", "error"] if fault else ["ok", "ok"]), str(report)
    for mode in MODES:
        real_model, real_x = _wav2vec2(fault)
        try:
            if mode == "train":
                real_model.train()
                real_model(real_x).last_hidden_state.float().sum().backward()
            else:
                real_model.eval()
                with torch.no_grad():
                    real_model(real_x)
            raised = False
        except RuntimeError:
            raised = True
        assert raised == fault
        assert _fake_verdict(report, mode) == raised, f"{mode}\n{report}"
    if fault:
        assert any((f.module or "").startswith("encoder.layers.1.feed_forward") for f in report.errors), str(report)
