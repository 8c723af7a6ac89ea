"""castwise.fsdp2.plan: the units and their dtypes, without a process group; fully_shard's refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import castwise
from castwise.fsdp2 import ShardError, fully_shard, plan
from tests.distributed._workers import tiny_llama

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def test_blocks_then_root_under_a_mixed_policy() -> None:
    p = plan(tiny_llama(), "bf16-mixed")
    assert [(u.name, u.kind) for u in p.units] == [
        ("model.layers.0", "block"),
        ("model.layers.1", "block"),
        ("", "root"),
    ]
    block, root = p.units[0], p.units[-1]
    assert (block.stored, block.gather, block.compute, block.reduce, block.output) == (F32, BF16, BF16, F32, None)
    assert (root.output, root.inputs) == (F32, BF16)  # f32 logits; float inputs cast to the gather dtype
    assert block.mp_policy_kwargs() == {
        "param_dtype": BF16,
        "reduce_dtype": F32,
        "output_dtype": None,
        "cast_forward_inputs": False,
    }
    assert sum(u.params for u in p.units) == sum(q.numel() for q in tiny_llama().parameters())
    assert p.param_casts == () and p.buffers == ()  # a mixed policy stores what the model has


def test_islands_are_their_own_units_inside_their_blocks_innermost_first() -> None:
    p = plan(tiny_llama(), "bf16-true")
    names = [u.name for u in p.units]
    assert names.index("model.layers.0.input_layernorm") < names.index("model.layers.0")
    island = p.unit("model.layers.0.input_layernorm")
    assert (island.kind, island.stored, island.gather, island.reduce, island.output, island.inputs) == (
        "island",
        F32,
        F32,
        F32,
        BF16,
        F32,
    )
    assert p.unit("model.layers.0").stored == BF16
    assert {c.name for c in p.buffers} == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    text = str(p)
    assert text.splitlines()[0].startswith("castwise.fsdp2 plan for LlamaForCausalLM under bf16-true: 8 units")
    assert "model.layers.0.input_layernorm" in text and "island" in text and "(root)" in text
    assert "buffers cast by castwise (FSDP2 leaves buffers as they are)" in text


def test_an_f16_island_saturates_and_a_reduce_clause_reaches_every_unit() -> None:
    p = plan(tiny_llama(), "16-mixed,keep[**.down_proj]=f32,reduce=bf16")
    island = p.unit("model.layers.1.mlp.down_proj")
    assert island.saturate and island.reduce == F32 and island.output == F16
    assert p.unit("model.layers.1").reduce == BF16 and p.unit("").reduce == BF16
    assert "loss scaling (dynamic)" in str(p)


def test_units_selectors_replace_the_repeated_blocks() -> None:
    p = plan(tiny_llama(), "bf16-mixed", units=["model.layers.*.mlp"])
    assert [u.name for u in p.units if u.kind == "unit"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    with pytest.raises(ShardError, match=r"units: 'model\.blocks\.\*' matches no module of LlamaForCausalLM"):
        plan(tiny_llama(), "bf16-mixed", units=["model.blocks.*"])


def test_a_model_without_no_split_modules_uses_its_module_lists() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    p = plan(model, "bf16-mixed")
    assert [u.name for u in p.units] == ["1.0", "1.1", "1.2", ""]


def test_fully_shard_needs_a_process_group_and_an_unapplied_model() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ShardError, match=r"init_process_group.*castwise\.fsdp2\.plan"):
        fully_shard(tiny_llama(), "bf16-mixed")
    model = tiny_llama()
    with castwise.apply(model, "bf16-mixed"), pytest.raises(ShardError, match=r"\.remove\(\)"):
        fully_shard(model, "bf16-mixed")


def test_importing_castwise_stays_light_and_reaches_the_new_modules() -> None:
    code = (
        "import sys, castwise; castwise.export; import castwise.export; "
        "print('torch' in sys.modules, callable(castwise.export.deepspeed))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_blocks_inside_an_island_gather_in_the_islands_dtype() -> None:
    p = plan(tiny_llama(), "bf16-mixed,keep[model.layers.1]=f32")
    inner = p.unit("model.layers.1")  # the island is the block itself: one unit, gathered in f32
    assert (inner.kind, inner.gather, inner.output) == ("island", F32, BF16)
    q = plan(tiny_llama(), "bf16-true,keep[model]=f32")
    block = q.unit("model.layers.0")
    assert (block.kind, block.stored, block.gather, block.compute, block.reduce) == ("block", F32, F32, F32, F32)
    assert q.unit("model").gather == F32 and q.unit("").gather == BF16


def test_an_island_returning_to_f16_is_clamped_before_the_cast() -> None:
    from castwise.fsdp2 import _cast_out

    forward = _cast_out(F16, True)(lambda x: (x * 1e6, x.long()))
    big, ints = forward(torch.ones(2))
    assert big.dtype == F16 and torch.isfinite(big).all() and ints.dtype == torch.int64
