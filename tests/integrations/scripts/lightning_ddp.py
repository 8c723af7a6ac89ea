"""A Lightning Trainer under DDP on two CPU processes (torchrun, gloo) with CastwiseCallback: each
rank's callback audits the replica that rank holds; prints what it audited."""

import logging

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from castwise.lightning import CastwiseCallback

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Probe(pl.Callback):
    """Says what the Trainer has wrapped the module in when the fit's callbacks start."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"rank {trainer.global_rank} fit starts on {type(trainer.strategy.model).__name__}")


torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
callback = CastwiseCallback(mode="train")
trainer = pl.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    precision="bf16-mixed",
    max_steps=2,
    callbacks=[Probe(), callback],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Net(), data)
report = callback.report
assert report is not None
print(f"rank {dist.get_rank() if dist.is_initialized() else trainer.global_rank} audited: ok={report.ok}")
