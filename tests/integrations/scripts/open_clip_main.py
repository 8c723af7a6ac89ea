"""A CLIP training entry point in the style of open_clip's training main (written for castwise's
tests: a tiny model config next to this file, built by open_clip's factory, CPU, random pairs).

``--precision amp_bf16`` trains float32 weights under the script's own autocast. ``--precision
bf16`` builds bf16 weights with open_clip's float32 LayerNorms (LayerNormFp32); ``--model-dtype
bf16`` plants the bug on top: the whole model is cast to bf16 "to match the images", and the
float32 LayerNorms' weights with it, which then refuse the float32 activations they make.
"""

import argparse
from contextlib import suppress
from functools import partial
from pathlib import Path

import open_clip
import torch


def parse_args(args=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="open_clip_tiny")
    parser.add_argument("--precision", default="amp_bf16", choices=["amp_bf16", "bf16", "fp32"])
    parser.add_argument("--model-dtype", default=None, choices=["bf16"], help="the planted bug")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=5e-4)
    return parser.parse_args(args)


def get_autocast(precision, device_type="cpu"):
    if precision == "amp_bf16":
        return partial(torch.autocast, device_type=device_type, dtype=torch.bfloat16)
    return suppress


def get_input_dtype(precision):
    return torch.bfloat16 if precision in ("bf16", "pure_bf16") else None


def train_one_epoch(model, data, loss, epoch, optimizer, args):
    autocast = get_autocast(args.precision)
    input_dtype = get_input_dtype(args.precision)
    model.train()
    for i, (images, texts) in enumerate(data):
        images = images.to(dtype=input_dtype)
        with autocast():
            model_out = model(images, texts)
            total_loss = loss(**model_out, output_dict=False)
        optimizer.zero_grad()
        total_loss.backward()
        optimizer.step()
        print(f"Train Epoch: {epoch} [{i}] Loss: {total_loss.item():.4f}")


def main(args):
    args = parse_args(args)
    torch.manual_seed(0)
    open_clip.add_model_config(Path(__file__).with_name(f"{args.model}.json"))
    model = open_clip.create_model(
        args.model, pretrained=None, precision=args.precision, device="cpu", output_dict=True
    )
    if args.model_dtype == "bf16":
        model = model.to(torch.bfloat16)
    loss = open_clip.ClipLoss()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    data = [(torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 64, (args.batch_size, 8))) for _ in range(2)]
    for epoch in range(args.epochs):
        train_one_epoch(model, data, loss, epoch, optimizer, args)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
