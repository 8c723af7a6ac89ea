"""diffusers UNet2DConditionModel from a toy config, as examples/text_to_image/train_text_to_image.py
sets it up (unet.enable_gradient_checkpointing() with --gradient_checkpointing; the script wraps
the step in accelerator.autocast, and compiles with torch.compile via accelerate's dynamo backend)."""

import sys

import diffusers
import torch
from harness import study

recipes = sys.argv[1].split(",") if len(sys.argv) > 1 else None


def build(gc: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    if gc:
        m.enable_gradient_checkpointing()
    return m


inputs = {
    "sample": torch.randn(2, 4, 8, 8),
    "timestep": torch.tensor([10, 20]),
    "encoder_hidden_states": torch.randn(2, 6, 32),
}
study("diffusers UNet2DCondition", build, inputs, recipes=recipes, build_gc=lambda: build(True))
