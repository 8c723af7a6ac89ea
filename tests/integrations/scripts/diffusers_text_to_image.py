"""A text-to-image fine-tuning script in the style of diffusers' train_text_to_image.py (written
for castwise's tests: tiny configs, CPU, random data; no weights are downloaded).

The frozen VAE and text encoder are cast to ``weight_dtype``; the UNet is trained in float32
under autocast with a GradScaler. ``--half_unet`` plants the bug: the trained UNet is cast to
float16 too, and ``GradScaler.unscale_`` refuses its gradients at the first step.
"""

import argparse

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel


def parse_args():
    parser = argparse.ArgumentParser(description="Fine-tune a (tiny) text-to-image UNet.")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="fp16")
    parser.add_argument("--max_train_steps", type=int, default=2)
    parser.add_argument("--train_batch_size", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--resolution", type=int, default=16)
    parser.add_argument("--half_unet", action="store_true", help="the planted bug")
    return parser.parse_args()


def build_models():
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
        )
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    return text_encoder, vae, unet


def main():
    args = parse_args()
    torch.manual_seed(0)
    text_encoder, vae, unet = build_models()
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)

    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.mixed_precision, torch.float32)
    # the frozen models only run inference: half precision saves memory
    vae.to(dtype=weight_dtype)
    text_encoder.to(dtype=weight_dtype)
    if args.half_unet:
        unet.to(dtype=weight_dtype)  # "to save memory": the trained model too

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate)
    scaler = torch.amp.GradScaler("cpu", enabled=args.mixed_precision == "fp16")
    autocast = torch.autocast("cpu", dtype=weight_dtype, enabled=args.mixed_precision != "no")

    unet.train()
    for step in range(args.max_train_steps):
        pixel_values = torch.randn(args.train_batch_size, 3, args.resolution, args.resolution)
        input_ids = torch.randint(0, 64, (args.train_batch_size, 8))
        with torch.no_grad():
            latents = vae.encode(pixel_values.to(weight_dtype)).latent_dist.sample()
            latents = latents * vae.config.scaling_factor
            encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        with autocast:
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
