"""CW230-CW232: the ledger's config rules, each with the look-alike that is fine."""

from __future__ import annotations

import json
from pathlib import Path

from castwise.lint import lint_config


def _codes(tmp_path: Path, name: str, data: dict[str, object] | str) -> list[str]:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return sorted(f.code for f in lint_config(path).findings)


def test_cw230_pure_bf16_names_the_lost_weights(tmp_path: Path) -> None:
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"output_dir": "o", "torch_dtype": "bfloat16", "learning_rate": 1e-5}))
    (f,) = lint_config(path).findings
    assert f.code == "CW230" and "|w| > 0.00256" in f.message and "learning_rate" in f.settings


def test_cw230_controls(tmp_path: Path) -> None:
    # f32 weights under bf16 autocast; DeepSpeed's default fp32 master; torchtitan f32 params
    assert _codes(tmp_path, "args.json", {"output_dir": "o", "torch_dtype": "float32", "bf16": True}) == []
    assert _codes(tmp_path, "ds_config.json", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}) == []
    assert _codes(tmp_path, "job.toml", '[job]\n[training]\nmixed_precision_param = "bfloat16"\n') == []
    ds = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}}
    assert _codes(tmp_path, "ds_config.json", ds) == ["CW230"]


def test_cw231_counts_micro_batches(tmp_path: Path) -> None:
    ds: dict[str, object] = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    assert _codes(tmp_path, "ds_config.json", {**ds, "gradient_accumulation_steps": 128}) == ["CW231"]
    assert _codes(tmp_path, "ds_config.json", {**ds, "gradient_accumulation_steps": 4}) == []
    fixed = {**ds, "gradient_accumulation_steps": 128, "data_types": {"grad_accum_dtype": "fp32"}}
    assert "CW231" not in _codes(tmp_path, "ds_config.json", fixed)


def test_cw232_only_for_gradients_computed_wider(tmp_path: Path) -> None:
    wide = '[job]\n[training]\nmixed_precision_param = "float32"\nmixed_precision_reduce = "bfloat16"\n'
    assert _codes(tmp_path, "job.toml", wide) == ["CW232"]
    narrow = '[job]\n[training]\nmixed_precision_param = "bfloat16"\nmixed_precision_reduce = "bfloat16"\n'
    assert _codes(tmp_path, "job.toml", narrow) == []  # gradients made in bf16: nothing more to lose


def test_megatron_script_no_longer_exits_2(tmp_path: Path) -> None:
    script = tmp_path / "pretrain_gpt.sh"
    script.write_text("torchrun pretrain_gpt.py --bf16 --grad-reduce-in-bf16 --global-batch-size 64\n")
    report = lint_config(script)
    precision = report.summary["precision"]
    assert precision["gradients"]["value"] == "bfloat16" and precision["master"]["value"] == "float32"


def test_cw231_estimate_is_the_measured_rounding_of_a_bf16_sum() -> None:
    """The model's error against a real bf16 accumulation: an MLP's gradients over N micro-batches
    summed into bf16 .grad, against the same micro-batches summed in f32 (grad_dtype)."""
    import copy

    import torch
    from torch import nn

    from castwise.lint.ledger_checks import accumulation_error

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)).bfloat16()
    wide = copy.deepcopy(model)
    for p in wide.parameters():
        p.grad_dtype = torch.float32
    for n in (32, 128):
        for m in (model, wide):
            m.zero_grad(set_to_none=True)
            gen = torch.Generator().manual_seed(n)
            for _ in range(n):
                m(torch.randn(16, 32, generator=gen).bfloat16()).float().pow(2).mean().backward()
        low = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        ref = torch.cat([p.grad.float().flatten() for p in wide.parameters()])
        measured = float((low - ref).norm() / ref.norm())
        assert 0.5 < accumulation_error(n, "bfloat16") / measured < 2.0, (n, measured)
    # the constant this replaced said ~6% at 32 micro-batches: 10x the measurement
    assert accumulation_error(32, "bfloat16") < 0.01
