"""A Lightning Trainer script (written for castwise's tests: a tiny sequence classifier, CPU,
random data). The precision is the Trainer's (``--precision bf16-mixed``).

``--late-head`` plants another: the head is made in ``on_fit_start``, after the Trainer's strategy
converted the model (precision plugin's convert_module), so under ``bf16-true`` it stays f32.

``--batch-first`` plants the bug: with batch-first layers and a padding mask, validation (no
grad, eval mode) takes PyTorch's nested-tensor fast path, which runs outside autocast and refuses
the bf16 activations autocast made; the sanity check before training fails.
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SequenceClassifier(L.LightningModule):
    def __init__(self, features=8, width=16, classes=3, batch_first=False, lr=1e-3, late_head=False):
        super().__init__()
        self.save_hyperparameters()
        self.proj = nn.Linear(features, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        if not late_head:
            self.head = nn.Linear(width, classes)

    def on_fit_start(self):
        if self.hparams.late_head:
            self.head = nn.Linear(self.hparams.width, self.hparams.classes)

    def forward(self, x, padding_mask):
        h = self.proj(x)
        if not self.hparams.batch_first:
            h = h.transpose(0, 1)
        h = self.encoder(h, src_key_padding_mask=padding_mask)
        if not self.hparams.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(dim=1))

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        loss = F.cross_entropy(self(x, mask).float(), y)
        print(f"train step {batch_idx}: loss {loss.item():.4f}")
        return loss

    def validation_step(self, batch, batch_idx):
        x, mask, y = batch
        acc = (self(x, mask).argmax(-1) == y).float().mean()
        print(f"val step {batch_idx}: acc {acc.item():.2f}")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--batch-first", action="store_true", help="the planted bug")
    parser.add_argument("--late-head", action="store_true", help="the head made after the conversion")
    args = parser.parse_args()
    L.seed_everything(7, verbose=False)
    padding_mask = torch.zeros(8, 5, dtype=torch.bool)
    padding_mask[1::2, 3:] = True  # every other sequence is 3 long, padded to 5
    data = TensorDataset(torch.randn(8, 5, 8), padding_mask, torch.randint(0, 3, (8,)))
    train, val = DataLoader(data, batch_size=4), DataLoader(data, batch_size=4)
    model = SequenceClassifier(batch_first=args.batch_first, late_head=args.late_head)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train, val)


if __name__ == "__main__":
    main()
