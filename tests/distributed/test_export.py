"""castwise.export: each output lints clean with castwise lint-config and is accepted by the
library's own config parsing (DeepSpeed's DeepSpeedConfig, Accelerate's launcher and FSDP
plugin, Lightning's Trainer)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import castwise
from castwise.export import ExportError, ExportWarning, accelerate, deepspeed, lightning
from castwise.lint import build_model, read_config

POLICIES = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "pure_bf16", "bf16-mixed,reduce=bf16"]
DS_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        return fn(*args, **kwargs)


def _lints_clean(path: Path) -> None:
    report = castwise.lint_config(path)
    assert report.findings == [], [f.to_dict() for f in report.findings]


@pytest.mark.parametrize("text", POLICIES)
def test_deepspeed_section_lints_clean_and_deepspeed_reads_it(text: str, tmp_path: Path) -> None:
    policy = castwise.Policy.parse(text)
    section = _quiet(deepspeed, policy)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**section, "train_micro_batch_size_per_gpu": 1}))
    _lints_clean(path)
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig({**section, "train_batch_size": 2})
    assert config.bfloat16_config.enabled == (policy.compute_dtype == torch.bfloat16)
    assert config.float16_config.enabled == (policy.compute_dtype == torch.float16)
    assert config.communication_data_type == policy.reduce_dtype
    if policy.compute_dtype != torch.float32:  # lint-config's model of the run reduces in communication_data_type
        model = build_model(read_config(path))
        assert model.reduce is not None and model.reduce.value == str(policy.reduce_dtype).removeprefix("torch.")


def test_deepspeed_fp16_scales_dynamically_unless_the_policy_fixes_a_scale() -> None:
    assert deepspeed("16-mixed")["fp16"]["loss_scale"] == 0
    assert deepspeed("16-mixed,loss_scale=128")["fp16"]["loss_scale"] == 128.0


def _accelerate_launch(path: Path) -> tuple[Any, dict[str, str]]:
    """Accelerate's own path from a config file to the FSDP plugin: the launcher's parsing, the
    environment it gives the processes, the plugin built from it."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "--num_processes", "2", "train.py"])
    args, _defaults, _mp = _validate_launch_command(args)
    return args, prepare_multi_gpu_env(args)


@pytest.mark.parametrize("text", ["32-true", "bf16-mixed,reduce=bf16", "16-mixed,reduce=f16"])
def test_accelerate_fsdp2_config_lints_clean_and_accelerate_builds_the_plugin(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    policy = castwise.Policy.parse(text)
    config = accelerate(policy)  # FSDP2 by default; no warning: everything this policy says fits the file
    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump(config))
    _lints_clean(path)
    args, env = _accelerate_launch(path)
    assert args.use_fsdp and env["FSDP_VERSION"] == "2"
    for key, value in env.items():
        monkeypatch.setitem(os.environ, key, value)
    plugin = FullyShardedDataParallelPlugin()
    if args.mixed_precision != "no":
        plugin.set_mixed_precision(args.mixed_precision)  # what Accelerator() does with mixed_precision
        mp = plugin.mixed_precision_policy
        assert (mp.param_dtype, mp.reduce_dtype) == (policy.compute_dtype, policy.reduce_dtype)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    model = build_model(read_config(path))
    assert model.compute is not None and model.compute.value == str(policy.compute_dtype).removeprefix("torch.")


@pytest.mark.parametrize("text", ["32-true", "bf16-mixed", "16-mixed"])
def test_accelerate_ddp_config_lints_clean_and_the_launcher_reads_it(text: str, tmp_path: Path) -> None:
    config = accelerate(text, fsdp=False)
    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump(config))
    _lints_clean(path)
    args, env = _accelerate_launch(path)
    assert args.mixed_precision == {"32-true": "no", "bf16-mixed": "bf16", "16-mixed": "fp16"}[text]
    assert env["ACCELERATE_MIXED_PRECISION"] == args.mixed_precision and not args.use_fsdp


def test_what_accelerate_cannot_say_is_a_warning_or_with_strict_an_error() -> None:
    with pytest.warns(ExportWarning, match=r"reduce=f32 \(Accelerate's FSDP reduces in bf16\)"):
        accelerate("bf16-mixed")  # the default reduce=f32 does not fit Accelerate's FSDP plugin
    with pytest.raises(ExportError, match=r"castwise\.fsdp2\.fully_shard"):
        accelerate("bf16-mixed,keep[*.norm]=f32", strict=True)
    with pytest.raises(ExportError, match="valid compute dtypes: bf16, f16, f32"):
        deepspeed("64-true")


@pytest.mark.parametrize("text", POLICIES)
def test_lightning_arguments_lint_clean_and_the_trainer_takes_them(text: str, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    policy = castwise.Policy.parse(text)
    arguments = _quiet(lightning, policy)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": arguments}))
    _lints_clean(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 16-mixed on CPU: Lightning says it runs bf16-mixed instead
        trainer = pl.Trainer(
            **arguments,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    plugin = trainer.strategy.precision_plugin
    want = arguments["precision"] if arguments["precision"] != "16-mixed" else "bf16-mixed"
    assert plugin.precision == want


def test_lightning_reads_castwise_presets_as_lightning_means_them() -> None:
    assert lightning("pure_bf16") == {"precision": "bf16-true"}
    with pytest.warns(ExportWarning, match=r"norms=f32"):
        assert lightning("bf16-true") == {"precision": "bf16-true"}  # castwise's adds f32 norm islands
    assert lightning("bf16-mixed") == {"precision": "bf16-mixed"}


def test_the_default_dtype_is_said_by_lightnings_true_precisions_and_left_to_the_script_elsewhere() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Lightning's *-true set the default dtype themselves
        assert lightning("lightning:bf16-true") == {"precision": "bf16-true"}
        assert lightning("lightning:16-true") == {"precision": "16-true"}
    with pytest.raises(ExportError, match=r"default_dtype=bf16 \(torch's default dtype while the model runs\)"):
        lightning("bf16-mixed,default_dtype=bf16", strict=True)
    with pytest.raises(ExportError, match=r"default_dtype=bf16"):
        deepspeed("lightning:bf16-true", strict=True)
    with pytest.raises(ExportError, match=r"default_dtype=f16"):
        accelerate("lightning:16-true", fsdp=False, strict=True)


def test_an_fp8_policy_is_not_exported_to_deepspeed_as_its_base_silently() -> None:
    with pytest.raises(ExportError, match=r"fp8=tensorwise \(float8 GEMMs: DeepSpeed's config has no FP8 setting"):
        deepspeed("fp8", strict=True)
    with pytest.warns(ExportWarning, match="fp8=tensorwise"):
        deepspeed("fp8")


@pytest.mark.parametrize(
    ("text", "backend", "env"),
    [
        (
            "fp8",
            "AO",
            {"ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "True", "ACCELERATE_FP8_PAD_INNER_DIM": "False"},
        ),
        (
            "bf16-mixed,fp8=delayed",
            "TE",
            {
                "ACCELERATE_FP8_FORMAT": "HYBRID",
                "ACCELERATE_FP8_AMAX_HISTORY_LEN": "1024",
                "ACCELERATE_FP8_MARGIN": "0",
            },
        ),
        ("mxfp8", "TE", {"ACCELERATE_FP8_FORMAT": "E4M3", "ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING": "True"}),
    ],
)
def test_accelerate_fp8_config_lints_clean_and_the_launcher_exports_it(
    text: str, backend: str, env: dict[str, str], tmp_path: Path
) -> None:
    config = _quiet(accelerate, text)
    assert config["mixed_precision"] == "fp8" and config["fp8_config"]["backend"] == backend
    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump(config))
    _lints_clean(path)
    args, launched = _accelerate_launch(path)
    assert args.mixed_precision == "fp8" and launched["ACCELERATE_FP8_BACKEND"] == backend
    assert {k: launched.get(k) for k in env} == env  # the variables Accelerate's recipe kwargs read


def test_the_ao_backend_reads_the_exported_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.utils import AORecipeKwargs

    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump(accelerate("fp8", fsdp=False)))
    _args, launched = _accelerate_launch(path)
    for key, value in launched.items():
        if key.startswith("ACCELERATE_FP8_"):
            monkeypatch.setenv(key, value)
    kwargs = AORecipeKwargs()
    assert kwargs.config is not None and kwargs.config.enable_fsdp_float8_all_gather is False
    assert kwargs.config.pad_inner_dim is False


def test_lightning_fp8_is_transformer_engine_and_torchao_recipes_are_left_to_the_script() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lightning("transformer-engine") == {"precision": "transformer-engine"}
        assert lightning("transformer-engine-float16") == {"precision": "transformer-engine-float16"}
    with pytest.raises(ExportError, match=r"fp8 format e4m3 .*recipe=\{'fp8_format': 'E4M3'\}"):
        lightning("transformer-engine,fp8=delayed:e4m3", strict=True)
    with pytest.raises(ExportError, match=r"fp8=tensorwise \(Lightning's float8 precision is TransformerEngine's"):
        lightning("fp8", strict=True)
    with pytest.warns(ExportWarning, match="the base precision --bf16"):
        assert lightning("--bf16 --fp8-format hybrid") == {"precision": "transformer-engine"}


def test_torchtitan_float8_sections_with_castwises_filter() -> None:
    from torch import nn

    from castwise.export import torchtitan

    out = torchtitan("fp8")
    assert out["training"] == {"mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"}
    assert out["model"] == {"converters": ["quantize.linear.float8"]}
    assert out["quantize"]["linear"]["float8"] == {
        "filter_fqns": ["output"],
        "enable_fsdp_float8_all_gather": True,
        "precompute_float8_dynamic_scale_for_fsdp": True,
    }
    rowwise = torchtitan("bf16-mixed,fp8=rowwise,keep[layers.0.wo]=bf16")["quantize"]["linear"]["float8"]
    assert rowwise == {"filter_fqns": ["output", "layers.0.wo"], "recipe_name": "rowwise"}
    mx = torchtitan("mxfp8")
    assert mx["model"] == {"converters": ["quantize.linear.mx"]}
    assert mx["quantize"]["linear"]["mx"]["recipe_name"] == "mxfp8_cublas"
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 24), nn.Linear(24, 8))
    assert torchtitan("fp8", model=model)["quantize"]["linear"]["float8"]["filter_fqns"] == ["1", "2"]
    with pytest.raises(ExportError, match=r"fp8=delayed \(torchtitan's float8 converter scales tensorwise or rowwise"):
        torchtitan("bf16-mixed,fp8=delayed", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torchtitan("bf16-mixed")["model"] == {"converters": []}


def _toml(sections: dict[str, Any], prefix: str = "") -> str:
    """A TOML document of nested tables of strings, bools, ints and string lists."""
    plain = {k: v for k, v in sections.items() if not isinstance(v, dict)}
    out = [f"[{prefix}]"] if prefix and plain else []
    out += [f"{k} = {json.dumps(v)}" for k, v in plain.items()]
    for key, value in sections.items():
        if isinstance(value, dict):
            out.append(_toml(value, f"{prefix}.{key}" if prefix else key))
    return "\n".join(out)


@pytest.mark.parametrize("text", ["fp8", "bf16-mixed,fp8=rowwise", "mxfp8", "bf16-mixed", "bf16-mixed,reduce=bf16"])
def test_torchtitan_sections_lint_clean_as_a_job_toml(text: str, tmp_path: Path) -> None:
    from castwise.export import torchtitan

    path = tmp_path / "job.toml"
    path.write_text(_toml(torchtitan(text)) + "\n")
    _lints_clean(path)
    (cf,) = read_config(path)
    assert cf.format == "torchtitan"
    model = build_model([cf])
    assert model.compute is not None
    assert model.compute.value == ("bfloat16" if "fp8" not in text else "float8_e4m3fn")
