"""Issue 33's repro: a diffusers AutoencoderKL returns DecoderOutput (a dataclass-dict that needs
``sample``); the numerics entries rebuilt it with a hand-written walker and crashed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import castwise

diffusers = pytest.importorskip("diffusers")


def _vae() -> Any:
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        layers_per_block=1,
    ).eval()


def test_every_numerics_entry_completes_on_a_diffusers_vae() -> None:
    x = torch.randn(1, 3, 16, 16)
    tuned = castwise.tune(_vae(), x, policy="bf16-true", budget=1e-1, mode="eval")
    assert tuned.raised == () and tuned.met and tuned.runs > 0
    compared = castwise.compare(_vae(), x, policy="bf16-true", mode="eval")
    assert compared.findings == [] and compared.summary["output_err"] is not None
    assert castwise.forecast(_vae(), x, target="bf16", mode="eval").findings == []
    assert castwise.locate_nonfinite(_vae(), x, mode="eval").findings == []
