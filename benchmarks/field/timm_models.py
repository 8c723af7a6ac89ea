"""timm (pytorch-image-models) models as train.py creates them (timm.create_model, no pretrained
weights), at toy sizes; train.py's --grad-checkpointing is model.set_grad_checkpointing()."""

import sys

import timm
import torch
from harness import study

which = sys.argv[1]
recipes = sys.argv[2].split(",") if len(sys.argv) > 2 else None
CONFIGS = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2, num_classes=10), 32),
    "resnet": ("resnet18", dict(num_classes=10), 32),
    "convnext": ("convnext_atto", dict(num_classes=10, depths=(1, 1, 1, 1)), 64),
}
name, kw, size = CONFIGS[which]


def build(gc: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, **kw)
    if gc:
        m.set_grad_checkpointing(True)
    return m


x = torch.randn(2, 3, size, size)
study(f"timm {name}", build, x, recipes=recipes, build_gc=lambda: build(True), dynamic_once=(which == "vit"))
