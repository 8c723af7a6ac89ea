"""What CastwiseCallback adds to fit start for a ~100M-parameter LightningModule.

Time from `trainer.fit()` to the first training step, with and without the callback,
interleaved in one process (bf16-mixed on CPU, a clean model so the fit goes on).

    python benchmarks/bench_lightning_callback.py [--rounds N]
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from castwise.lightning import CastwiseCallback


class Big(pl.LightningModule):
    def __init__(self, dim: int = 768, layers: int = 14) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, 12, 4 * dim, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, dim)

    def training_step(self, batch: tuple[torch.Tensor], idx: int) -> torch.Tensor:
        return self.head(self.encoder(batch[0])).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Stop(pl.Callback):
    """Records when the first training step starts (max_steps=1 ends the fit after it)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if self.at is None:
            self.at = time.perf_counter()


def time_to_first_step(module: Big, with_castwise: bool) -> float:
    stop = Stop()
    callbacks: list[pl.Callback] = [stop] + ([CastwiseCallback()] if with_castwise else [])
    trainer = pl.Trainer(
        precision="bf16-mixed",
        accelerator="cpu",
        max_steps=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = DataLoader(TensorDataset(torch.randn(4, 16, 768)), batch_size=2)
    start = time.perf_counter()
    trainer.fit(module, data)
    assert stop.at is not None
    return stop.at - start


def main() -> None:
    warnings.filterwarnings("ignore")
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    module = Big()
    n = sum(p.numel() for p in module.parameters())
    base, cast = [], []
    for _ in range(rounds):
        base.append(time_to_first_step(module, False))
        cast.append(time_to_first_step(module, True))
    b, c = statistics.median(base), statistics.median(cast)
    print(f"parameters: {n / 1e6:.0f}M")
    print(f"fit start to first step: without {b:.2f}s, with CastwiseCallback {c:.2f}s")
    print(f"added by the callback: {c - b:.2f}s ({c / b:.1f}x)")


if __name__ == "__main__":
    main()
