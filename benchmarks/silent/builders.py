"""Seeded builders of the silent cases' models and inputs: real library models from tiny configs
(transformers, timm, diffusers; nothing downloaded) and the hand-written kernels."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from benchmarks.silent import kernels as k
from benchmarks.silent import models as m
from benchmarks.silent.truth import Built
from torch import nn

VOCAB = 8192  # logprobs near -9: the bf16 grid there is 0.0625 wide


def _seed() -> None:
    torch.manual_seed(0)


def causal_lm(kind: str, **over: Any) -> nn.Module:
    import transformers as tf

    _seed()
    common: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 1}
    common.update(over)
    if kind == "gpt2":  # its default token ids (50256) are outside the small vocabulary
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    attn = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_cls(config_cls(**common, **attn))


def sharpen(model: nn.Module, scale: float = 15.0) -> nn.Module:
    """Scale the query and key projections so attention is peaked, as in a trained model (at a
    random init the scores are ~0 and attention is uniform whatever the positions say)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("q_proj", "k_proj")) and isinstance(module, nn.Linear):
                module.weight.mul_(scale)
    return model


def _tokens(batch: int, seq: int, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def lm_loss(kind: str, upcast: bool = False, hf_loss: bool = False) -> Built:
    model = m.LMLoss(causal_lm(kind), upcast=upcast, hf_loss=hf_loss)
    return Built(model, {"input_ids": _tokens(2, 32), "labels": _tokens(2, 32, seed=2)})


def rl_policy(kind: str) -> Built:
    model = m.RLPolicy(causal_lm(kind), temperature=0.7)
    return Built(model, {"input_ids": _tokens(2, 32), "labels": _tokens(2, 32, seed=2)})


def lm_at_positions(kind: str, float_positions: bool = False) -> Built:
    theta = {"llama": 500000.0, "qwen2": 1000000.0}[kind]
    lm = sharpen(causal_lm(kind, max_position_embeddings=65536, rope_theta=theta))
    pos = torch.arange(16)[None] + 30000  # a long-context continuation
    pos = pos.float() if float_positions else pos
    return Built(m.LMOut(lm), {"input_ids": _tokens(1, 16, seed=3), "position_ids": pos})


def masked_lm(long_mask: bool, kind: str = "llama") -> Built:
    lm = sharpen(causal_lm(kind, max_position_embeddings=4096, vocab_size=512))
    mask = torch.ones(1, 1024, dtype=torch.long if long_mask else torch.float32)
    return Built(m.MaskedLM(lm), {"input_ids": _tokens(1, 1024, vocab=512, seed=4), "attention_mask": mask})


def _vit(**over: Any) -> nn.Module:
    import timm

    _seed()
    kwargs: dict[str, Any] = {"img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 1000, **over}
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs)


def _images(batch: int, seed: int = 5) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def vit_classifier() -> Built:
    target = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(6))
    return Built(m.Classifier(_vit()), {"x": _images(16), "target": target})


class _Logits(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": out.float().square().mean(), "out": out}


def vit_loop_norm() -> Built:
    # a ViT-B width (768 channels): the loop's running sum outgrows the bf16 grid of its addends
    net = _vit(embed_dim=768, depth=1, num_heads=12)
    net.norm = k.ChunkRMSNorm(768, chunk=1)
    return Built(_Logits(net), {"x": _images(4)})


def aux_moe() -> Built:
    _seed()
    return Built(k.AuxTask(), {"x": torch.randint(0, 4096, (4096,), generator=torch.Generator().manual_seed(17))})


def strong_condition(net: nn.Module, scale: float = 8.0) -> nn.Module:
    """Scale the timestep embedder's output layer: a trained DiT's adaLN conditioning moves its
    activations far more than a random init's does."""
    with torch.no_grad():
        for name, module in net.named_modules():
            if name.endswith("timestep_embedder.linear_2") and isinstance(module, nn.Linear):
                module.weight.mul_(scale)
    return net


def dit(long_timestep: bool) -> Built:
    from diffusers import DiTTransformer2DModel

    _seed()
    net = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=1000,
    )
    # a float schedule's timesteps (utensils/mold#786: 937.5); bf16 has a 4-wide grid above 512
    t = torch.tensor([937, 622]) if long_timestep else torch.tensor([937.5, 621.9])
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(7))
    return Built(
        m.Denoiser(strong_condition(net)), {"hidden_states": x, "timestep": t, "class_labels": torch.tensor([3, 7])}
    )


def sd3() -> Built:
    from diffusers import SD3Transformer2DModel

    _seed()
    net = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
    )
    g = torch.Generator().manual_seed(8)
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 4, 32, generator=g),
        "pooled_projections": torch.randn(2, 16, generator=g),
        "timestep": torch.tensor([937.5, 621.9]),  # a flow-matching schedule's float timesteps
    }
    return Built(m.Denoiser(strong_condition(net)), inputs)


def tiny_dit() -> Built:
    _seed()
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(9))
    return Built(m.TinyDiT(), {"x": x, "t": torch.tensor([998.39, 431.7])})


def rope_lm(f32_phase: bool) -> Built:
    _seed()
    pos = torch.arange(64)[None] + 3000
    return Built(m.RopeLM(m.NeoXRotary(16, f32_phase)), {"input_ids": _tokens(1, 64, 512, 10), "position_ids": pos})


def cast_rope_lm() -> Built:
    _seed()
    pos = torch.arange(64)[None] + 20000
    return Built(m.RopeLM(m.CastRotary(16)), {"input_ids": _tokens(1, 64, 512, 11), "position_ids": pos})


def _trunk(kind: str) -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    if kind == "embed":
        return nn.Embedding(4096, 64), torch.randint(0, 4096, (1024,), generator=g)
    if kind == "vit":
        from timm.layers import PatchEmbed

        return PatchEmbed(img_size=32, patch_size=4, in_chans=3, embed_dim=64), torch.randn(16, 3, 32, 32, generator=g)
    from diffusers.models.embeddings import PatchEmbed as DiffusersPatchEmbed

    trunk = DiffusersPatchEmbed(height=16, width=16, patch_size=2, in_channels=4, embed_dim=64)
    return trunk, torch.randn(16, 4, 16, 16, generator=g)


def moe(trunk: str, type_as: bool = False, f32: bool = False) -> Built:
    _seed()
    net, x = _trunk(trunk)
    router = k.Router(64, 32, 2, type_as=type_as, f32=f32)
    return Built(k.MoETask(net, k.MoE(64, router, 32)), {"x": x})


def bias_moe() -> Built:
    _seed()
    net, x = _trunk("embed")
    return Built(k.MoETask(net, k.MoE(64, k.BiasRouter(64, 32, 4), 32)), {"x": x})


def norm_lm(chunk: int, acc_f32: bool = False, kahan: bool = False) -> Built:
    _seed()
    norm = k.ChunkRMSNorm(512, chunk=chunk, acc_f32=acc_f32, kahan=kahan)
    return Built(k.NormLM(norm, dim=512), {"input_ids": _tokens(1, 64, 512, 14)})


def scan_lm() -> Built:
    _seed()
    return Built(k.ScanLM(), {"input_ids": _tokens(1, 1024, 512, 15)})
