"""castwise.float8.scaling.scale against torchao's own scale functions, recipe by recipe."""

from __future__ import annotations

import pytest
import torch

from castwise.float8 import scaling
from castwise.policy.float8 import Float8Recipe


def _rows() -> torch.Tensor:
    """REVIEW.md's repro (rows of 1, 3, 0.07 and 300), a row of zeros and a row with an Inf."""
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.tensor([1.0, 3.0, 0.07, 300.0, 0.0, 1.0]).unsqueeze(1)
    x[5, 7] = torch.inf
    return x


def test_tensorwise_is_torchaos_tensor_to_scale() -> None:
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_utils import tensor_to_scale

    cc = Float8LinearConfig().cast_config_input  # torchao's default recipe: tensorwise
    for x in (_rows()[:5], _rows(), torch.zeros(4, 64), torch.randn(4, 64) * 1e-19):
        theirs = tensor_to_scale(x, cc.target_dtype, scaling_granularity=cc.scaling_granularity)
        ours = scaling.scale(x, Float8Recipe("tensorwise"))
        assert torch.equal(ours, theirs)


def test_rowwise_is_torchaos_power_of_two_rowwise_scale() -> None:
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_utils import tensor_to_scale

    cfg = Float8LinearConfig.from_recipe_name("rowwise")
    cc = cfg.cast_config_input
    assert cfg.round_scales_to_power_of_2  # the recipe's setting, which compare used to miss
    x = _rows()
    theirs = tensor_to_scale(
        x,
        cc.target_dtype,
        scaling_granularity=cc.scaling_granularity,
        axiswise_dim=-1,
        round_scales_to_power_of_2=cfg.round_scales_to_power_of_2,
    )
    ours = scaling.scale(x, Float8Recipe("rowwise"))
    assert torch.equal(ours, theirs)
    assert ours[:4, 0].tolist() == [128.0, 32.0, 2048.0, 0.5]  # REVIEW.md's rows, as forecast scored them


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_is_torchaos_rceil_e8m0_block_scale(fmt: str) -> None:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

    recipe = Float8Recipe("mxfp8", fmt)  # type: ignore[arg-type]
    f8 = scaling.dtype(recipe)
    mode = MXFP8TrainingOpConfig().scale_calculation_mode  # what apply's MX training uses
    x = _rows()
    x[1, 32:] = 0.0  # an all-zero block
    x[2, :32] *= 1e-30  # a block under float32's normal range once scaled
    e8m0, data = to_mx(x, f8, scaling.MX_BLOCK, mode)
    ours = scaling.scale(x, recipe)
    fmax = torch.finfo(f8).max
    mine = (x * ours).clamp(-fmax, fmax).to(f8)
    assert torch.equal(mine.view(torch.uint8), data.view(torch.uint8))  # the same float8 bits
    blocks = ours[:, :: scaling.MX_BLOCK]
    theirs = 1 / get_fp_scale(e8m0)
    live = x.reshape(6, -1, scaling.MX_BLOCK).abs().amax(-1) > 0
    assert torch.equal(blocks[live], theirs[live])  # the E8M0 scale of every non-zero block
    assert bool((blocks[~live] == 1).all())  # torchao multiplies an all-zero block by 1
