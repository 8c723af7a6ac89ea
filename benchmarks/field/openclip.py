"""open_clip CLIP from toy vision/text configs (open_clip.CLIP(embed_dim, CLIPVisionCfg, CLIPTextCfg)),
as open_clip's training/main.py builds it (--torchcompile compiles the model; --grad-checkpointing is
model.set_grad_checkpointing())."""

import sys

import open_clip
import torch
from harness import study
from open_clip.model import CLIPTextCfg, CLIPVisionCfg

recipes = sys.argv[1].split(",") if len(sys.argv) > 1 else None
vision = CLIPVisionCfg(layers=2, width=32, head_width=16, patch_size=8, image_size=32)
text = CLIPTextCfg(context_length=16, vocab_size=128, width=32, heads=2, layers=2)


def build(gc: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = open_clip.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text)
    if gc:
        m.set_grad_checkpointing(True)
    return m


image = torch.randn(2, 3, 32, 32)
tokens = torch.randint(0, 128, (2, 16))
study("open_clip CLIP", build, (image, tokens), recipes=recipes, build_gc=lambda: build(True))
