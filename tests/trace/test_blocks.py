"""Repeated blocks and their static keys (trace/blocks.py): alike blocks share a key; a hook, a
cast, a swapped forward or a differing plain attribute sets a block apart."""

from __future__ import annotations

import types
from typing import Any

import torch
import transformers
from torch import nn

from castwise.trace.blocks import find_blocks, static_key


def _llama(layers: int = 3) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_decoder_layers_are_the_blocks_outermost_only() -> None:
    model = _llama(3)
    assert list(find_blocks(model)) == [f"model.layers.{i}" for i in range(3)]
    # leaf layers side by side are not worth a record
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))) == {}


def test_alike_layers_share_a_key_though_their_index_differs() -> None:
    layers = _llama(3).model.layers
    assert layers[0].self_attn.layer_idx != layers[2].self_attn.layer_idx
    assert static_key(layers[0]) == static_key(layers[2]) is not None


def _output_hook(module: nn.Module, args: Any, output: Any) -> Any:
    return output


def test_a_hook_anywhere_keeps_the_block_out() -> None:
    layers = _llama(3).model.layers
    layers[1].mlp.down_proj.register_forward_hook(_output_hook)
    layers[2].self_attn.q_proj.weight.register_hook(lambda g: g)  # type: ignore[no-untyped-call]
    assert static_key(layers[1]) is None
    assert static_key(layers[2]) is None


def test_a_cast_a_swapped_forward_or_an_attribute_sets_a_block_apart() -> None:
    layers = _llama(5).model.layers
    layers[1].mlp.down_proj.to(torch.bfloat16)
    layers[2].mlp.act_fn = nn.GELU()
    layers[3].post_attention_layernorm.variance_epsilon = 1e-3

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x

    layers[4].mlp.forward = types.MethodType(forward, layers[4].mlp)  # type: ignore[method-assign]
    first = static_key(layers[0])
    assert all(static_key(layers[i]) != first for i in range(1, 5))


def _closure(scale: float) -> Any:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x * scale

    return forward


def test_instance_forwards_compare_by_code_and_closure() -> None:
    layers = _llama(3).model.layers
    for i, scale in enumerate((2.0, 2.0, 3.0)):
        mlp = layers[i].mlp
        mlp.forward = types.MethodType(_closure(scale), mlp)  # type: ignore[method-assign]
    assert static_key(layers[0]) == static_key(layers[1])  # one closure per module, alike
    assert static_key(layers[0]) != static_key(layers[2])
