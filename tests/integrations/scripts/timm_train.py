"""An image classification training script in the style of timm's train.py (written for
castwise's tests: a tiny ViT built by timm from its config, CPU, random images).

``--amp`` trains under the script's own autocast (``--amp-dtype``), with a loss scaler for
float16. ``--model-dtype bfloat16 --no-input-cast`` plants the bug: the model's weights are cast
to bfloat16 and the loader's float32 images are not, so the patch embedding refuses them.
"""

import argparse
from contextlib import suppress
from functools import partial

import timm
import torch
import torch.nn as nn
from timm.utils import NativeScaler

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (tiny)")
parser.add_argument("--model", default="vit_tiny_patch16_224", type=str)
parser.add_argument("--num-classes", type=int, default=10)
parser.add_argument("-b", "--batch-size", type=int, default=2)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--amp", action="store_true", default=False, help="use mixed precision training")
parser.add_argument("--amp-dtype", default="bfloat16", type=str)
parser.add_argument("--model-dtype", default=None, type=str, help="train the model in this dtype")
parser.add_argument("--no-input-cast", action="store_true", help="the planted bug: images stay float32")


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, amp_autocast, loss_scaler, model_dtype, cast_input):
    model.train()
    for batch_idx, (input, target) in enumerate(loader):
        if cast_input and model_dtype is not None:
            input = input.to(dtype=model_dtype)
        with amp_autocast():
            output = model(input)
            loss = loss_fn(output, target)
        optimizer.zero_grad()
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, parameters=model.parameters())
        else:
            loss.backward()
            optimizer.step()
        print(f"Train: {epoch} [{batch_idx}] Loss: {loss.item():.4f}")


def validate(model, loader, amp_autocast, model_dtype):
    model.eval()
    correct = 0
    with torch.no_grad():
        for input, target in loader:
            if model_dtype is not None:
                input = input.to(dtype=model_dtype)
            with amp_autocast():
                output = model(input)
            correct += (output.argmax(-1) == target).sum().item()
    print(f"Test: Acc@1: {100.0 * correct / sum(len(t) for _, t in loader):.2f}")


def main():
    args = parser.parse_args()
    torch.manual_seed(42)
    device = torch.device("cpu")
    model = timm.create_model(
        args.model,
        pretrained=False,
        num_classes=args.num_classes,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
    )
    model_dtype = getattr(torch, args.model_dtype) if args.model_dtype else None
    model.to(device=device, dtype=model_dtype)

    amp_autocast = suppress
    loss_scaler = None
    if args.amp:
        amp_dtype = getattr(torch, args.amp_dtype)
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if amp_dtype == torch.float16:
            loss_scaler = NativeScaler(device=device.type)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    loader = [(torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, args.num_classes, (args.batch_size,)))] * 2
    for epoch in range(args.epochs):
        train_one_epoch(
            epoch, model, loader, optimizer, loss_fn, amp_autocast, loss_scaler, model_dtype, not args.no_input_cast
        )
        validate(model, loader, amp_autocast, model_dtype)


if __name__ == "__main__":
    main()
