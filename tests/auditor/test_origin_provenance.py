"""The origin does not flip with parameter counts: a large float32 table kept on purpose does not
make a bf16 model "float32 with one module cast by hand" (issue 21, item 6)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import castwise
from castwise.auditor.session import dominant_dtype


def _openclip_bf16(vocab: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A small OpenCLIP as `precision="bf16"` builds it (LayerNormFp32 islands, embeddings f32,
    the rest bf16), with block 0's ln_1 dropping its cast back to the input's dtype."""
    import open_clip
    from open_clip.model import convert_weights_to_lp
    from open_clip.transformer import LayerNormFp32

    torch.manual_seed(0)
    model = open_clip.CLIP(
        embed_dim=64,
        vision_cfg={"image_size": 32, "layers": 2, "width": 64, "patch_size": 16, "head_width": 32},
        text_cfg={"context_length": 16, "vocab_size": vocab, "width": 64, "heads": 2, "layers": 2},
    )
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(parent, name, LayerNormFp32(child.normalized_shape, eps=child.eps))
    convert_weights_to_lp(model, dtype=torch.bfloat16)
    ln = model.transformer.resblocks[0].ln_1

    def no_cast_back(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.to(torch.float32), self.normalized_shape, self.weight, self.bias, self.eps)

    ln.forward = types.MethodType(no_cast_back, ln)
    return model, (torch.randn(1, 3, 32, 32, dtype=torch.bfloat16), torch.randint(0, vocab, (1, 16)))


@pytest.mark.parametrize("vocab", [1000, 49408])
def test_the_float32_island_is_the_origin_whatever_the_vocabulary(vocab: int) -> None:
    model, inputs = _openclip_bf16(vocab)
    with pytest.raises(RuntimeError, match="same dtype"):
        model(*inputs)  # the real run fails
    report = castwise.audit(model, inputs, mode="train")
    first = report.errors[0]
    assert (first.code, first.module) == ("CW102", "transformer.resblocks.0.attn")
    assert first.origin is not None and first.origin.module == "transformer.resblocks.0.ln_1"
    assert not any(f.code == "CW113" for f in report.errors)
    # the user put this model in bf16: never the float32 policy as the way out
    assert report.suggested_policy is not None and not str(report.suggested_policy).startswith("32-true")


def test_the_compute_dtype_is_what_the_compute_layers_are_in() -> None:
    model, _ = _openclip_bf16(49408)
    numel = {d: sum(p.numel() for p in model.parameters() if p.dtype == d) for d in (torch.float32, torch.bfloat16)}
    assert numel[torch.float32] > numel[torch.bfloat16]  # the table outweighs every block
    assert dominant_dtype(model) == torch.bfloat16


def test_one_module_cast_by_hand_in_a_float32_model_is_still_that_module() -> None:
    model = nn.Sequential(nn.Embedding(50_000, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    model[2].to(torch.bfloat16)
    report = castwise.audit(model, torch.randint(0, 50_000, (2, 3)), mode="train")
    assert [(f.code, f.module) for f in report.errors][:1] == [("CW113", "2")]


class _F64UnderAutocast(nn.Module):
    """The user's own bf16 autocast around an f32 model with one layer left in f64 (``.double()``):
    autocast casts f32 only, so the f64 layer meets the bf16 activations and the real run fails."""

    def __init__(self, left: str) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(16)
        getattr(self, left).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.norm(self.b(self.a(x)))


@pytest.mark.parametrize("left", ["b", "norm"])
def test_a_layer_left_in_f64_under_autocast_is_the_origin_not_autocasts_activation(left: str) -> None:
    model, x = _F64UnderAutocast(left), torch.randn(2, 16)
    with pytest.raises(RuntimeError):
        copy.deepcopy(model)(x)  # the real run fails
    report = castwise.audit(model, x, mode="eval")
    first = report.errors[0]
    assert first.module == left
    # the bf16 activation is what the user's autocast makes; the f64 weight is what was changed
    assert first.origin is not None and first.origin.module == left, str(report)
