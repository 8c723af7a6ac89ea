"""The recipes: the ways people really train a model in low precision, each written as the code a
user puts around the model (own autocast, checkpointing, a Lightning Trainer precision, Accelerate,
LoRA over a bf16 base, torchao float8), and the zoo models they are run on.

A recipe's ``prepare(model, inputs)`` returns what the user runs, or raises ``NotApplicable``
(HF checkpointing on a model that is not a Hugging Face one). ``faults`` is the zoo situation
whose fault classes make sense under the recipe (benchmarks/zoo/faults.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from benchmarks.recipes import wrappers
from benchmarks.zoo import models
from benchmarks.zoo.faults import NotApplicable
from torch import nn
from torch.utils._pytree import tree_map_only

BF16, F16 = torch.bfloat16, torch.float16
Built = tuple[nn.Module, Any]

# >= 20 zoo models: LLMs, encoders, ViTs, CLIP, LoRA, diffusion (the SD training step below)
MODELS = (
    "llama",
    "mistral",
    "qwen2",
    "phi",
    "gpt_neox",
    "gpt2",
    "opt",
    "t5",
    "bart",
    "bert",
    "roberta",
    "vit",
    "swin",
    "timm_vit",
    "timm_resnet",
    "tv_vit",
    "clip_hf",
    "open_clip",
    "peft_lora_llama",
    "peft_lora_gpt2",
    "diffusers_dit",
    "sd_train_step",
)


class SDTrainStep(nn.Module):
    """diffusers' train_text_to_image step: a frozen VAE encodes the image to latents, a frozen
    text encoder the caption, noise is added and the UNet (trained) predicts it; the loss is the
    f32 MSE. The frozen parts are cast to ``weight_dtype`` (the script does this under mixed
    precision) by the recipe, the UNet stays f32."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel

        self.vae: nn.Module = AutoencoderKL(  # type: ignore[no-untyped-call, assignment]
            in_channels=3,
            out_channels=3,
            block_out_channels=(8, 16),
            norm_num_groups=4,
            latent_channels=4,
            layers_per_block=1,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        )
        text = CLIPTextConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
        )
        self.text_encoder = CLIPTextModel(text)
        self.unet: nn.Module = UNet2DConditionModel(  # type: ignore[no-untyped-call, assignment]
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(8, 16),
            norm_num_groups=4,
            cross_attention_dim=16,
            attention_head_dim=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )
        self.vae.requires_grad_(False)
        self.text_encoder.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        weight_dtype = next(self.vae.parameters()).dtype
        latents = self.vae.encode(pixel_values.to(weight_dtype)).latent_dist.sample() * 0.18215  # type: ignore[operator]
        noise = torch.randn_like(latents)
        alpha = (1.0 - timesteps.float() / 1000.0).view(-1, 1, 1, 1)
        noisy = latents * alpha.sqrt() + noise * (1.0 - alpha).sqrt()  # the DDPM add_noise, one step
        hidden = self.text_encoder(input_ids)[0]
        pred = self.unet(noisy, timesteps, hidden).sample
        return nn.functional.mse_loss(pred.float(), noise.float())


def build(name: str, seed: int) -> Built:
    """A zoo model (or the SD training step) and its inputs, seeded."""
    if name != "sd_train_step":
        return models.build(name, seed)
    torch.manual_seed(seed)
    return SDTrainStep(), {
        "pixel_values": torch.randn(2, 3, 16, 16),
        "input_ids": torch.randint(0, 64, (2, 5)),
        "timesteps": torch.tensor([10, 500]),
    }


# -- the recipes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    name: str
    prepare: Callable[[nn.Module, Any], Built]
    faults: str  # the zoo situation whose fault classes are planted under this recipe
    lightning: str | None = None  # the Trainer's precision string (a Lightning recipe)
    doc: str = ""
    trainer: str | None = None  # the HF Trainer's precision flag ("bf16" / "fp16"): an HF Trainer recipe
    # where a planted fault goes: into the model the user built, before the recipe's code takes it
    # (an engine's cast or FSDP2's sharding sees the bug), or into what the user runs
    plant_first: bool = False
    session: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def _frozen_parts_to(model: nn.Module, dtype: torch.dtype) -> None:
    """train_text_to_image's ``vae.to(weight_dtype)``, ``text_encoder.to(weight_dtype)``."""
    if isinstance(model, SDTrainStep):
        model.vae.to(dtype)
        model.text_encoder.to(dtype)


def autocast(dtype: torch.dtype) -> Callable[[nn.Module, Any], Built]:
    def prepare(model: nn.Module, inputs: Any) -> Built:
        _frozen_parts_to(model, dtype)
        return wrappers.OwnAutocast(model, dtype), inputs

    return prepare


def accelerate(dtype: torch.dtype) -> Callable[[nn.Module, Any], Built]:
    def prepare(model: nn.Module, inputs: Any) -> Built:
        _frozen_parts_to(model, dtype)
        return wrappers.AccelerateAutocast(model, dtype), inputs

    return prepare


def torch_checkpoint(use_reentrant: bool) -> Callable[[nn.Module, Any], Built]:
    def prepare(model: nn.Module, inputs: Any) -> Built:
        if wrappers.checkpoint_blocks(model, use_reentrant) == 0:
            raise NotApplicable("no blocks to checkpoint")
        return wrappers.OwnAutocast(model, BF16), inputs

    return prepare


def _hf_base(model: nn.Module) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base if getattr(base, "supports_gradient_checkpointing", False) else None


def _enable_hf_checkpointing(model: nn.Module) -> None:
    base = _hf_base(model)
    if base is None:
        raise NotApplicable("not a Hugging Face model with gradient checkpointing")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(base, "enable_input_require_grads"):
        base.enable_input_require_grads()  # what peft / the HF Trainer do for checkpointing


def hf_checkpointing(model: nn.Module, inputs: Any) -> Built:
    _enable_hf_checkpointing(model)
    return wrappers.OwnAutocast(model, BF16), inputs


def lora_bf16_base(model: nn.Module, inputs: Any) -> Built:
    """LoRA (peft) over a bf16 base: the base cast to bf16, f32 adapters (peft's default
    ``autocast_adapter_dtype``), floating inputs cast to bf16; no autocast."""
    if hasattr(model, "peft_config"):  # a zoo LoRA model: its base to bf16, adapters kept
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.data = p.data.to(BF16)
    else:
        if not hasattr(model, "config") or not hasattr(model, "get_input_embeddings"):
            raise NotApplicable("peft's all-linear targets need a Hugging Face model")
        from peft import LoraConfig, get_peft_model

        model.to(BF16)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))  # type: ignore[arg-type]
    return model, tree_map_only(torch.Tensor, lambda t: t.to(BF16) if t.is_floating_point() else t, inputs)


def _float8_able(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_emulated(model: nn.Module, inputs: Any) -> Built:
    """torchao's float8 training, emulated (runs on CPU), under the user's bf16 autocast."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True), module_filter_fn=_float8_able)
    if sum(type(m) is nn.Linear for m in model.modules()) == before:
        raise NotApplicable("no Linear with float8-able shapes")
    return wrappers.OwnAutocast(model, BF16), inputs


def _floats_to(inputs: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, inputs)


def deepspeed(dtype: torch.dtype) -> Callable[[nn.Module, Any], Built]:
    """DeepSpeed's engine in fp16/bf16 mode: ``DeepSpeedEngine._cast_module_mixed_precision``
    (deepspeed 0.19) casts every floating parameter to the engine's dtype and keeps the buffers
    as loaded (rotary ``inv_freq`` stays f32); no autocast; the HF Trainer under DeepSpeed casts
    the batch's floating inputs to that dtype (``_prepare_input``)."""

    def prepare(model: nn.Module, inputs: Any) -> Built:
        for p in model.parameters():
            if p.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and p.dtype != dtype:
                p.data = p.data.to(dtype)
        return model, _floats_to(inputs, dtype)

    return prepare


@contextlib.contextmanager
def fake_group() -> Iterator[None]:
    """torch.distributed's fake process group (rank 0 of 2, collectives do nothing) for one case:
    FSDP2 runs for real on CPU; destroyed after, so the other recipes' trainers see no group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2(dtype: torch.dtype) -> Callable[[nn.Module, Any], Built]:
    """torch's FSDP2 ``fully_shard`` per block and at the root with ``MixedPrecisionPolicy(
    param_dtype=dtype, reduce_dtype=f32)`` (torchtitan's): parameters stored f32 and gathered in
    ``dtype``, each unit's floating inputs cast to it, outputs left as computed."""

    def prepare(model: nn.Module, inputs: Any) -> Built:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if any(p.dim() == 0 for p in model.parameters()):
            raise NotApplicable("fully_shard refuses scalar parameters (CLIP's logit_scale)")
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for blocks in wrappers.block_lists(model):
            for block in blocks:
                fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, inputs

    return prepare


def fsdp1(dtype: torch.dtype) -> Callable[[nn.Module, Any], Built]:
    """torch's FSDP1 ``FullyShardedDataParallel`` with the blocks as its auto-wrap classes,
    ``MixedPrecision(param_dtype=dtype, reduce_dtype=f32, buffer_dtype=dtype)`` and
    ``use_orig_params=True`` (Accelerate's default; LoRA needs it): batch norm runs in its own
    wrapper with mixed precision off, the root's floating inputs are cast to ``dtype``."""

    def prepare(model: nn.Module, inputs: Any) -> Built:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)
        blocks = {type(b) for bs in wrappers.block_lists(model) for b in bs}
        try:
            wrapped = FullyShardedDataParallel(
                model,
                mixed_precision=mp,
                auto_wrap_policy=ModuleWrapPolicy(blocks) if blocks else None,
                device_id=torch.device("cpu"),
                use_orig_params=True,
            )
        except ValueError as exc:  # "Must flatten tensors with uniform dtype": the script stops at the wrap
            raise NotApplicable(f"FSDP1 refuses to wrap the model: {exc}") from exc
        return wrapped, inputs

    return prepare


def hf_trainer(model: nn.Module, inputs: Any) -> Built:
    return model, inputs  # the Trainer itself is the recipe (benchmarks/recipes/hf.py)


def lightning(precision: str, hf_gc: bool = False) -> Callable[[nn.Module, Any], Built]:
    def prepare(model: nn.Module, inputs: Any) -> Built:
        from benchmarks.recipes.lit import LitRecipe

        if hf_gc:
            _enable_hf_checkpointing(model)
        return LitRecipe(model), inputs

    return prepare


_RECIPES = [
    Recipe("autocast-bf16", autocast(BF16), "bf16-mixed", doc="own torch.autocast(x.device.type, bf16) in forward"),
    Recipe("autocast-f16", autocast(F16), "16-mixed", doc="own torch.autocast(x.device.type, f16) in forward"),
    Recipe("ckpt-reentrant", torch_checkpoint(True), "bf16-mixed", doc="checkpoint(use_reentrant=True) per block"),
    Recipe("ckpt-nonreentrant", torch_checkpoint(False), "bf16-mixed", doc="checkpoint(use_reentrant=False)"),
    Recipe("hf-gc", hf_checkpointing, "bf16-mixed", doc="HF gradient_checkpointing_enable() + bf16 autocast"),
    Recipe("accelerate-bf16", accelerate(BF16), "bf16-mixed", doc="Accelerate autocast + convert_outputs_to_fp32"),
    Recipe("lora-bf16-base", lora_bf16_base, "bf16-hand", doc="peft LoRA (f32 adapters) over a bf16 base"),
    *(
        Recipe(f"lightning-{p}", lightning(p), p, lightning=p, doc=f"Lightning Trainer({p}) + CastwiseCallback")
        for p in ("bf16-true", "bf16-mixed", "16-true", "16-mixed")
    ),
    Recipe(
        "lightning-bf16-mixed-gc",
        lightning("bf16-mixed", hf_gc=True),
        "bf16-mixed",
        lightning="bf16-mixed",
        doc="Lightning Trainer(bf16-mixed) + CastwiseCallback, HF gradient_checkpointing_enable()",
    ),
]
_RECIPES += [
    *(
        Recipe(f"hf-trainer-{p}", hf_trainer, s, trainer=p, doc=f"HF Trainer({p}=True) + CastwiseTrainerCallback")
        for p, s in (("bf16", "bf16-mixed"), ("fp16", "16-mixed"))
    ),
    *(
        Recipe(f"deepspeed-{n}", deepspeed(d), s, plant_first=True, doc=f"DeepSpeed {n}: params cast by the engine")
        for n, d, s in (("bf16", BF16, "bf16-hand"), ("fp16", F16, "f16-hand"))
    ),
    Recipe(
        "fsdp2-bf16",
        fsdp2(BF16),
        "bf16-mixed",
        plant_first=True,
        session=fake_group,
        doc="FSDP2 fully_shard(MixedPrecisionPolicy(bf16, reduce f32)) per block, fake process group",
    ),
    Recipe(
        "fsdp1-bf16",
        fsdp1(BF16),
        "bf16-mixed",
        plant_first=True,
        session=fake_group,
        doc="FSDP1 FullyShardedDataParallel(MixedPrecision(bf16, reduce f32, buffers bf16)), blocks wrapped",
    ),
]
if importlib.util.find_spec("torchao") is not None:
    _RECIPES.append(Recipe("float8-emulated", float8_emulated, "bf16-mixed", doc="torchao Float8Linear, emulate=True"))
RECIPES: dict[str, Recipe] = {r.name: r for r in _RECIPES}
