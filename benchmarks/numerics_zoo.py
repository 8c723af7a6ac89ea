"""Real models built from configs (no download) for the numerics benchmarks, small enough for a
CPU: transformers (BERT, GPT-2, Llama, Qwen2, T5, ViT), timm, torchvision and torch.nn models.
Each builder returns (model in float32, inputs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _ids(vocab: int, n: int = 16, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n))


def bert() -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ids = _ids(128)
    return BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


def gpt2() -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    ids = _ids(128)
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def llama() -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    ids = _ids(128)
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def qwen2() -> tuple[nn.Module, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    ids = _ids(128)
    return Qwen2ForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def t5() -> tuple[nn.Module, Any]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    ids = _ids(128)
    return T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": ids}


def vit() -> tuple[nn.Module, Any]:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return ViTForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 2])}


def timm_convnext() -> tuple[nn.Module, Any]:
    import timm

    return timm.create_model("test_convnext", num_classes=10), (torch.randn(2, 3, 64, 64),)


def timm_efficientnet() -> tuple[nn.Module, Any]:
    import timm

    return timm.create_model("test_efficientnet", num_classes=10), (torch.randn(2, 3, 64, 64),)


def torchvision_resnet() -> tuple[nn.Module, Any]:
    from torchvision.models import resnet18

    return resnet18(num_classes=10), (torch.randn(2, 3, 32, 32),)


def torchvision_mobilenet() -> tuple[nn.Module, Any]:
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(num_classes=10), (torch.randn(2, 3, 64, 64),)


class Seq2Seq(nn.Module):
    """nn.Transformer with an output head (the sum of a LayerNorm's output has no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(
            d_model=32,
            nhead=4,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=64,
            dropout=0.0,
            batch_first=True,
        )
        self.head = nn.Linear(32, 8)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.head(self.transformer(src, tgt))


def nn_transformer() -> tuple[nn.Module, Any]:
    return Seq2Seq(), (torch.randn(2, 10, 32), torch.randn(2, 7, 32))


class LSTMTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.lstm = nn.LSTM(32, 32, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.lstm(self.embed(ids))[0]))


def nn_lstm() -> tuple[nn.Module, Any]:
    return LSTMTagger(), (torch.randint(0, 100, (2, 12)),)


MODELS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "bert": bert,
    "gpt2": gpt2,
    "llama": llama,
    "qwen2": qwen2,
    "t5": t5,
    "vit": vit,
    "timm_convnext": timm_convnext,
    "timm_efficientnet": timm_efficientnet,
    "torchvision_resnet18": torchvision_resnet,
    "torchvision_mobilenet_v3": torchvision_mobilenet,
    "nn_transformer": nn_transformer,
    "nn_lstm": nn_lstm,
}
# held out: never tuned on; a benchmark's --held-out scores them (with other seeds) too. Built
# by the audit zoo's own builders (benchmarks/zoo/models.py): more libraries and norms
HELD_OUT_ZOO = ("mistral", "gemma", "phi", "bart", "swin", "diffusers_vae", "diffusers_dit", "timm_nfnet")


def held_out() -> dict[str, Callable[[], tuple[nn.Module, Any]]]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the audit zoo imports benchmarks.zoo
    from benchmarks.zoo import models as zoo

    def builder(name: str) -> Callable[[], tuple[nn.Module, Any]]:
        def build() -> tuple[nn.Module, Any]:
            model, inputs = zoo.REGISTRY[name].build()
            return model, inputs if isinstance(inputs, (dict, tuple)) else (inputs,)

        return build

    return {name: builder(name) for name in HELD_OUT_ZOO if zoo.REGISTRY[name].available()}


def half_inputs(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.half() if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(half_inputs(x) for x in obj)
    if isinstance(obj, dict):
        return {k: half_inputs(v) for k, v in obj.items()}
    return obj


def call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss.float()
    t = out if isinstance(out, torch.Tensor) else out[0]
    return t.float().sum()
