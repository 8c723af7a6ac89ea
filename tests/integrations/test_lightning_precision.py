"""CastwiseCallback under each of Lightning's low precisions, on real CPU fits of Lightning's own
demo Transformer (it builds its positional-encoding table in forward, without a dtype): a fit
that trains is never stopped, and the callback leaves the fit as it was (same batches, random
streams and weights), while a real dtype bug is still found."""

from __future__ import annotations

import inspect
import random
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.demos.transformer import Transformer
from torch.utils.data import DataLoader, Dataset

from castwise.lightning import CastwiseAuditError, CastwiseCallback

VOCAB, BLOCK = 40, 8
# what the Trainer makes of each string on CPU (16-mixed has no CPU autocast: Lightning warns and
# runs bf16-mixed); 64-true sets the default dtype too (f64)
PRECISIONS = {
    "bf16-true": "bf16-true",
    "bf16-mixed": "bf16-mixed",
    "16-true": "16-true",
    "16-mixed": "bf16-mixed",
    "64-true": "64-true",
}


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A WikiText2-like token stream with a random crop per item (numpy's global generator)."""

    def __init__(self) -> None:
        self.data = torch.randint(0, VOCAB, (16 * BLOCK + 8,), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start = index * BLOCK + int(np.random.randint(0, 4))
        return self.data[start : start + BLOCK], self.data[start + 1 : start + BLOCK + 1], index


class DemoLM(pl.LightningModule):
    """lightning.pytorch.demos' Transformer (dropout on), tiny; python's random picks a
    per-step augmentation, so an audit that drew from it would shift the fit."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=16, nlayers=1, dropout=0.2)
        self.seen: list[list[int]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target, index = batch
        if random.random() < 0.5:
            inputs = inputs.flip(1)
        self.seen.append(index.tolist())
        out = self.model(inputs, target)
        return torch.nn.functional.nll_loss(out.float(), target.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@dataclass(frozen=True)
class Fit:
    precision: str
    weights: dict[str, torch.Tensor]
    start: dict[str, torch.Tensor]
    seen: list[list[int]]
    streams: tuple[Any, ...]
    callback: CastwiseCallback | None


def _streams() -> tuple[Any, ...]:
    np_state = np.random.get_state()
    return torch.get_rng_state(), random.getstate(), (np_state[0], np_state[1].tolist(), *np_state[2:])


def _fit(precision: str, callback: CastwiseCallback | None) -> Fit:
    pl.seed_everything(7, verbose=False)
    module = DemoLM()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    loader = DataLoader(Tokens(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11))
    trainer = pl.Trainer(
        precision=precision,  # type: ignore[arg-type]
        accelerator="cpu",
        max_steps=3,
        callbacks=[callback] if callback is not None else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    return Fit(str(trainer.precision), weights, start, module.seen, _streams(), callback)


@pytest.fixture(scope="module", params=sorted(PRECISIONS))
def fits(request: pytest.FixtureRequest) -> tuple[Fit, Fit]:
    """The same seeded fit without and with the callback (one pair per precision)."""
    plain = _fit(request.param, None)
    return plain, _fit(request.param, CastwiseCallback())


def test_a_fit_that_trains_completes_with_the_callback_and_no_error_finding(fits: tuple[Fit, Fit]) -> None:
    plain, audited = fits
    assert plain.precision == audited.precision in PRECISIONS.values()
    assert len(plain.seen) == 3 and any(not torch.equal(plain.start[k], plain.weights[k]) for k in plain.start)
    assert audited.callback is not None and audited.callback.report is not None
    assert audited.callback.report.ok and not audited.callback.report.errors, audited.callback.report
    assert len(audited.seen) == 3 and audited.callback.applied is None


def test_the_callback_leaves_batches_random_streams_and_weights_as_they_were(fits: tuple[Fit, Fit]) -> None:
    plain, audited = fits
    assert audited.seen == plain.seen  # the same batches, in the same order
    assert all(torch.equal(a, b) for a, b in zip(audited.streams[0:1], plain.streams[0:1], strict=True))
    assert audited.streams[1:] == plain.streams[1:]  # python's random, numpy's
    assert audited.weights.keys() == plain.weights.keys()
    assert all(torch.equal(audited.weights[k], plain.weights[k]) for k in plain.weights), [
        k for k in plain.weights if not torch.equal(audited.weights[k], plain.weights[k])
    ]


class Tables(pl.LightningModule):
    """Two tables built in the step: one without a dtype (bf16 under Lightning's bf16-true: fine)
    and one made float32 on purpose, which meets bf16 activations (a real bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        h = self.proj(batch[0]) + torch.ones(8)  # default dtype: bf16 while the step runs
        bias = torch.zeros(8, dtype=torch.float32)  # the bug
        out: torch.Tensor = self.head(h + bias)
        return out.float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _tables_trainer(callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        precision="bf16-true",
        accelerator="cpu",
        max_steps=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_an_explicit_float32_table_under_bf16_true_is_still_found_and_only_it() -> None:
    data = DataLoader([(torch.randn(8),) for _ in range(4)], batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="dtype"):  # the real failure, without castwise
            _tables_trainer([]).fit(Tables(), data)
        with pytest.raises(CastwiseAuditError) as info:
            _tables_trainer([CastwiseCallback()]).fit(Tables(), data)
    lines, first = inspect.getsourcelines(Tables.training_step)
    bug = first + next(i for i, line in enumerate(lines) if "# the bug" in line)
    # the bug, and nothing about the table made with the default dtype
    errors = info.value.report.errors
    assert [(f.code, f.module) for f in errors] == [("CW106", "head")], str(info.value)
    assert errors[0].source == f"tests/integrations/test_lightning_precision.py:{bug}"
    assert torch.get_default_dtype() == torch.float32  # restored after the audit and the failed fit


class Indexed(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch[1].tolist())
        out: torch.Tensor = self.proj(batch[0]).pow(2).mean()
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _worker_fit(callbacks: list[pl.Callback]) -> list[list[int]]:
    pl.seed_everything(5, verbose=False)
    data = [(torch.full((4,), float(i)), i) for i in range(8)]
    loader = DataLoader(
        data, batch_size=2, shuffle=True, num_workers=1, persistent_workers=True, generator=torch.Generator()
    )
    module = Indexed()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return module.seen


def test_a_loader_with_persistent_workers_gives_the_fit_the_same_batches() -> None:
    """Such a loader keeps the first iterator made from it: the one the callback's batch came
    from must not be the one the fit goes on with."""
    assert _worker_fit([CastwiseCallback()]) == _worker_fit([])
