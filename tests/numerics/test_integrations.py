"""watch=True on the Lightning and Hugging Face trainer callbacks: a NaN planted at a random
step stops training with the producer named, before the optimizer steps on it."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from castwise.lightning import CastwiseCallback
from castwise.numerics.watch import NonfiniteError


class Planted(nn.Module):
    """Divides by zero at a step drawn from the global generator: replayable with the same RNG."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if float(torch.rand(())) < self.p:
            h = h / (h - h)
        return h


class Module(pl.LightningModule):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Planted(p), nn.Linear(8, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)


def _fit(module: pl.LightningModule, callback: CastwiseCallback) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader())


def test_lightning_watch_names_the_producer_before_the_optimizer_step() -> None:
    torch.manual_seed(3)
    module = Module(p=0.15)
    callback = CastwiseCallback(watch=True)
    with pytest.raises(NonfiniteError) as info:
        _fit(module, callback)
    finding = info.value.report.findings[0]
    assert (finding.code, finding.module, finding.op) == ("CW302", "net.2", "aten.div")
    # the optimizer never stepped on the non-finite gradient: every weight is still finite
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_lightning_watch_off_by_default_and_quiet_when_finite() -> None:
    torch.manual_seed(3)
    callback = CastwiseCallback(watch=True)
    _fit(Module(p=0.0), callback)
    assert callback._watch is not None and callback._watch.report is None


def test_transformers_watch_names_the_producer() -> None:
    from transformers import Trainer, TrainingArguments

    from castwise.integrations.transformers import CastwiseTrainerCallback

    class HFNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 8), Planted(0.2), nn.Linear(8, 1))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}

    torch.manual_seed(1)
    model = HFNet()
    args = TrainingArguments(
        output_dir="/tmp/castwise-hf-watch",
        per_device_train_batch_size=4,
        num_train_epochs=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Data(), callbacks=[CastwiseTrainerCallback(watch=True, mode="train")]
    )
    with pytest.raises(NonfiniteError) as info:
        trainer.train()
    finding = info.value.report.findings[0]
    assert (finding.code, finding.module) == ("CW302", "net.1")
    assert "forward" not in model.__dict__  # the watch took its wrapper off when it stopped training
