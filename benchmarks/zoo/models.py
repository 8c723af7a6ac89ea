"""The model zoo: small real models from configs (nothing downloaded), each a builder
``() -> (model, inputs)`` tagged with its library and whether it is held out.

Sizes are tiny (a few thousand to a few hundred thousand parameters) so that one real CPU run
takes well under a second; the architectures are the libraries' own. About a fifth of the zoo
is held out (``heldout=True``): tuning the engine against the zoo must not look at them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from benchmarks.zoo import nn_models
from torch import nn

Built = tuple[nn.Module, Any]


@dataclass(frozen=True)
class ZooModel:
    name: str
    library: str  # transformers, timm, torchvision, open_clip, diffusers, peft, torch.nn
    build: Callable[[], Built]
    heldout: bool = False

    def available(self) -> bool:
        module = {"torch.nn": "torch", "open_clip": "open_clip"}.get(self.library, self.library)
        return importlib.util.find_spec(module) is not None


REGISTRY: dict[str, ZooModel] = {}


def _register(name: str, library: str, heldout: bool = False) -> Callable[[Callable[[], Built]], Callable[[], Built]]:
    def deco(fn: Callable[[], Built]) -> Callable[[], Built]:
        REGISTRY[name] = ZooModel(name, library, fn, heldout)
        return fn

    return deco


def ids(n: int = 8, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n))


def image(size: int = 32, channels: int = 3) -> torch.Tensor:
    return torch.randn(2, channels, size, size)


# -- transformers ---------------------------------------------------------------------------------

_DEC = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}


def _hf(config: str, model: str, inputs: Callable[[], Any], **cfg: Any) -> Built:
    import transformers

    conf = getattr(transformers, config)(**cfg)
    return getattr(transformers, model)(conf), inputs()


def _causal(config: str, model: str, **cfg: Any) -> Built:
    return _hf(config, model, lambda: {"input_ids": ids()}, **{**_DEC, **cfg})


_register("llama", "transformers")(lambda: _causal("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2))
_register("mistral", "transformers")(lambda: _causal("MistralConfig", "MistralForCausalLM", num_key_value_heads=2))
_register("qwen2", "transformers")(lambda: _causal("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2))
_register("gemma", "transformers", heldout=True)(
    lambda: _causal("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8)
)
_register("phi", "transformers")(lambda: _causal("PhiConfig", "PhiForCausalLM"))
_register("gpt_neox", "transformers")(lambda: _causal("GPTNeoXConfig", "GPTNeoXForCausalLM"))
_register("falcon", "transformers", heldout=True)(lambda: _causal("FalconConfig", "FalconForCausalLM"))
_register("mixtral", "transformers")(
    lambda: _causal(
        "MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    )
)
_register("gpt2", "transformers")(
    lambda: _hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        lambda: {"input_ids": ids()},
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
    )
)
_register("opt", "transformers")(
    lambda: _hf(
        "OPTConfig",
        "OPTForCausalLM",
        lambda: {"input_ids": ids()},
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    )
)
_register("bloom", "transformers", heldout=True)(
    lambda: _hf(
        "BloomConfig",
        "BloomForCausalLM",
        lambda: {"input_ids": ids()},
        vocab_size=64,
        hidden_size=32,
        n_layer=2,
        n_head=4,
    )
)
_register("t5", "transformers")(
    lambda: _hf(
        "T5Config",
        "T5ForConditionalGeneration",
        lambda: {"input_ids": ids(), "decoder_input_ids": ids(5)},
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
    )
)
_register("bart", "transformers")(
    lambda: _hf(
        "BartConfig",
        "BartForConditionalGeneration",
        lambda: {"input_ids": ids(), "decoder_input_ids": ids(5)},
        vocab_size=64,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
)

_ENC = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


def _encoder(config: str, model: str, **cfg: Any) -> Built:
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0  # padding: the attention mask path runs too
    return _hf(config, model, lambda: {"input_ids": ids(), "attention_mask": mask}, **{**_ENC, **cfg})


_register("bert", "transformers")(lambda: _encoder("BertConfig", "BertForSequenceClassification"))
_register("roberta", "transformers")(lambda: _encoder("RobertaConfig", "RobertaForMaskedLM"))
_register("electra", "transformers", heldout=True)(
    lambda: _encoder("ElectraConfig", "ElectraForPreTraining", embedding_size=16)
)
_register("albert", "transformers")(lambda: _encoder("AlbertConfig", "AlbertModel", embedding_size=16))
_register("deberta_v2", "transformers")(lambda: _encoder("DebertaV2Config", "DebertaV2Model"))
_register("distilbert", "transformers")(
    lambda: _hf(
        "DistilBertConfig",
        "DistilBertModel",
        lambda: {"input_ids": ids()},
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
        max_position_embeddings=64,
    )
)

_VIS = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}
_register("vit", "transformers")(
    lambda: _hf("ViTConfig", "ViTForImageClassification", lambda: {"pixel_values": image()}, **_VIS)
)
_register("deit", "transformers", heldout=True)(
    lambda: _hf("DeiTConfig", "DeiTModel", lambda: {"pixel_values": image()}, **_VIS)
)
_register("swin", "transformers")(
    lambda: _hf(
        "SwinConfig",
        "SwinModel",
        lambda: {"pixel_values": image()},
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
    )
)
_register("convnext_hf", "transformers")(
    lambda: _hf(
        "ConvNextConfig",
        "ConvNextModel",
        lambda: {"pixel_values": image()},
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
    )
)
_register("resnet_hf", "transformers")(
    lambda: _hf(
        "ResNetConfig",
        "ResNetModel",
        lambda: {"pixel_values": image()},
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
    )
)
_register("wav2vec2", "transformers")(
    lambda: _hf(
        "Wav2Vec2Config",
        "Wav2Vec2Model",
        lambda: {"input_values": torch.randn(2, 400)},
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(8, 8),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_feat_extract_layers=2,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
)
_register("whisper", "transformers", heldout=True)(
    lambda: _hf(
        "WhisperConfig",
        "WhisperModel",
        lambda: {"input_features": torch.randn(2, 16, 16), "decoder_input_ids": ids(4)},
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=8,
        max_target_positions=16,
    )
)


def _hf_clip() -> Built:
    from transformers import CLIPConfig, CLIPModel

    text = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 16,
    }
    vision = {**_VIS}
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    return model, {"input_ids": ids(), "pixel_values": image()}


_register("clip_hf", "transformers")(_hf_clip)


# -- timm -----------------------------------------------------------------------------------------


def _timm(name: str, size: int = 32, **kwargs: Any) -> Built:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10, **kwargs), image(size)


_register("timm_resnet", "timm")(lambda: _timm("test_resnet"))
_register("timm_vit", "timm")(
    lambda: _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)
)
_register("timm_convnext", "timm")(lambda: _timm("test_convnext"))
_register("timm_efficientnet", "timm", heldout=True)(lambda: _timm("test_efficientnet"))
_register("timm_byobnet", "timm")(lambda: _timm("test_byobnet"))
_register("timm_nfnet", "timm")(lambda: _timm("test_nfnet"))
_register("timm_mobilenetv3", "timm")(lambda: _timm("mobilenetv3_small_050"))
_register("timm_deit", "timm", heldout=True)(
    lambda: _timm("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)
)


# -- torchvision ----------------------------------------------------------------------------------


def _tv(name: str, size: int = 32, **kwargs: Any) -> Built:
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs), image(size)


def _tv_vit() -> Built:
    from torchvision.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    return model, image()


def _tv_resnet() -> Built:
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10), image()


_register("tv_resnet", "torchvision")(_tv_resnet)
_register("tv_mobilenet_v2", "torchvision")(lambda: _tv("mobilenet_v2", width_mult=0.25))
_register("tv_squeezenet", "torchvision", heldout=True)(lambda: _tv("squeezenet1_1", size=48))
_register("tv_shufflenet", "torchvision")(lambda: _tv("shufflenet_v2_x0_5"))
_register("tv_vit", "torchvision")(_tv_vit)


# -- open_clip ------------------------------------------------------------------------------------


def _open_clip(**kwargs: Any) -> Built:
    import open_clip
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    vision = CLIPVisionCfg(layers=2, width=32, head_width=16, patch_size=8, image_size=32)
    text = CLIPTextCfg(context_length=16, vocab_size=100, width=32, heads=2, layers=2)
    model = open_clip.model.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text, **kwargs)
    return model, (image(), torch.randint(0, 100, (2, 16)))


_register("open_clip", "open_clip")(_open_clip)
_register("open_clip_quickgelu", "open_clip", heldout=True)(lambda: _open_clip(quick_gelu=True))


def _open_clip_custom_text() -> Built:
    import open_clip
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    vision = CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=8, image_size=32)
    text = CLIPTextCfg(context_length=16, vocab_size=100, width=32, heads=2, layers=1)
    model = open_clip.model.CustomTextCLIP(embed_dim=16, vision_cfg=vision, text_cfg=text)
    return model, (image(), torch.randint(0, 100, (2, 16)))


_register("open_clip_custom_text", "open_clip")(_open_clip_custom_text)


# -- diffusers ------------------------------------------------------------------------------------


def _unet2d() -> Built:
    from diffusers import UNet2DModel

    model: nn.Module = UNet2DModel(  # type: ignore[no-untyped-call, assignment]
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    return model, (torch.randn(2, 3, 16, 16), torch.tensor([10, 20]))


def _unet_cond() -> Built:
    from diffusers import UNet2DConditionModel

    model: nn.Module = UNet2DConditionModel(  # type: ignore[no-untyped-call, assignment]
        sample_size=16,
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
    return model, (torch.randn(2, 4, 16, 16), torch.tensor([10, 20]), torch.randn(2, 5, 16))


def _vae() -> Built:
    from diffusers import AutoencoderKL

    model: nn.Module = AutoencoderKL(  # type: ignore[no-untyped-call, assignment]
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        latent_channels=4,
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    )
    return model, torch.randn(2, 3, 16, 16)


def _dit() -> Built:
    from diffusers import DiTTransformer2DModel

    model: nn.Module = DiTTransformer2DModel(  # type: ignore[no-untyped-call, assignment]
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    return model, {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "timestep": torch.tensor([1, 2]),
        "class_labels": torch.tensor([0, 3]),
    }


_register("diffusers_unet2d", "diffusers")(_unet2d)
_register("diffusers_unet_cond", "diffusers", heldout=True)(_unet_cond)
_register("diffusers_vae", "diffusers")(_vae)
_register("diffusers_dit", "diffusers")(_dit)


# -- peft -----------------------------------------------------------------------------------------


def _lora(base: Callable[[], Built], targets: list[str]) -> Built:
    from peft import LoraConfig, get_peft_model

    model, inputs = base()
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets)), inputs


_register("peft_lora_llama", "peft")(
    lambda: _lora(lambda: _causal("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2), ["q_proj", "v_proj"])
)
_register("peft_lora_bert", "peft", heldout=True)(
    lambda: _lora(lambda: _encoder("BertConfig", "BertModel"), ["query", "value"])
)
_register("peft_lora_gpt2", "peft")(
    lambda: _lora(
        lambda: _hf(
            "GPT2Config",
            "GPT2LMHeadModel",
            lambda: {"input_ids": ids()},
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
        ),
        ["c_attn"],
    )
)


# -- torch.nn -------------------------------------------------------------------------------------


def _mlp() -> Built:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.SiLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    return model, torch.randn(4, 16)


def _encoder_stack() -> Built:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 4:] = True
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (torch.randn(2, 6, 32), None, mask)


def _seq2seq() -> Built:
    model = nn.Transformer(
        d_model=32,
        nhead=4,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=64,
        batch_first=True,
        dropout=0.0,
    )
    return model, (torch.randn(2, 6, 32), torch.randn(2, 5, 32))


def _conv1d() -> Built:
    model = nn.Sequential(
        nn.Conv1d(4, 8, 3, padding=1),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Conv1d(8, 8, 3, padding=1),
        nn.InstanceNorm1d(8, affine=True),
        nn.AdaptiveMaxPool1d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )
    return model, torch.randn(2, 4, 20)


_register("nn_mlp", "torch.nn")(_mlp)
_register("nn_convnet", "torch.nn")(lambda: (nn_models.ConvNet(), image(16)))
_register("nn_lstm", "torch.nn", heldout=True)(lambda: (nn_models.Recurrent(nn.LSTM), ids(7)))
_register("nn_gru", "torch.nn")(lambda: (nn_models.Recurrent(nn.GRU), ids(7)))
_register("nn_mha", "torch.nn")(lambda: (nn_models.MHAClassifier(), torch.randn(2, 5, 12)))
_register("nn_transformer_encoder", "torch.nn")(_encoder_stack)
_register("nn_transformer", "torch.nn", heldout=True)(_seq2seq)
_register("nn_conv1d", "torch.nn")(_conv1d)


def models(*, heldout: bool | None = None, library: str | None = None) -> list[ZooModel]:
    """The registered models, in registration order; ``heldout``: only held-out (True) or only
    tuning (False) models; libraries that are not installed are left out."""
    return [
        m
        for m in REGISTRY.values()
        if (heldout is None or m.heldout == heldout) and (library is None or m.library == library) and m.available()
    ]


def build(name: str, seed: int = 0) -> Built:
    """The model and inputs, the same for the same seed (weights and inputs are drawn from it)."""
    torch.manual_seed(seed)
    return REGISTRY[name].build()
