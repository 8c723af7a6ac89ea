"""Per format: a realistic file that lints clean, one with a contradiction that is found, and
the precision model traced back to the settings (file and line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from castwise.lint import build_model, lint_config, read_config

FIX = Path(__file__).parent / "fixtures"


def codes(path: Path | list[Path]) -> list[str]:
    return sorted(f.code for f in lint_config(path).findings)


@pytest.mark.parametrize(
    "name",
    [
        "simpletuner/clean.env",
        "simpletuner/clean.json",
        "simpletuner/clean.toml",
        "accelerate/single_gpu_bf16.yaml",
        "accelerate/fsdp_fp16.yaml",
        "accelerate/deepspeed_ok/default_config.yaml",
        "deepspeed/zero2_fp16.json",
        "deepspeed/bf16_fp32_accum.json",
        "lightning/cli_bf16.yaml",
        "lightning/plugin_only.yaml",
        "hf/clean_bf16.json",
        "hf/with_ds/training_args.json",
    ],
)
def test_realistic_file_lints_clean(name: str) -> None:
    report = lint_config(FIX / name)
    assert report.findings == []
    assert report.ok


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("simpletuner/story5.env", "CW201"),
        ("simpletuner/grad_fp32.json", "CW201"),
        ("simpletuner/grad_fp32.toml", "CW201"),
        ("accelerate/deepspeed_mismatch/default_config.yaml", "CW203"),
        ("deepspeed/both_enabled.json", "CW202"),
        ("lightning/plugin_and_precision.yaml", "CW205"),
        ("hf/both_fp16_bf16.json", "CW202"),
    ],
)
def test_contradiction_is_found(name: str, code: str) -> None:
    report = lint_config(FIX / name)
    assert codes(FIX / name) == [code]
    assert not report.ok


def test_story5_names_both_settings_as_written_with_lines() -> None:
    path = FIX / "simpletuner" / "story5.env"
    (finding,) = lint_config(path).findings
    assert finding.level == "error"
    assert finding.settings == ("MIXED_PRECISION", "--base_model_precision", "--gradient_precision")
    assert finding.locations == (f"{path}:4", f"{path}:8", f"{path}:9")
    assert "--gradient_precision" in (finding.fix or "")
    data = finding.to_dict()
    assert data["settings"][0] == "MIXED_PRECISION" and data["settings"][-1] == "--gradient_precision"


def test_story5_precision_model() -> None:
    path = FIX / "simpletuner" / "story5.env"
    model = build_model(read_config(path))
    assert model.weights is not None and model.weights.value == "bfloat16"
    assert [s.name for s in model.weights.settings] == ["MIXED_PRECISION", "--base_model_precision"]
    assert model.gradients is not None and model.gradients.value == "float32"
    assert model.gradient_mechanism == "cast"
    assert [(s.name, s.line) for s in model.gradients.settings] == [("--gradient_precision", 9)]
    assert model.compute is not None and model.compute.value == "bfloat16"
    assert model.loss_scaling is not None and model.loss_scaling.value == "none"
    assert model.device is None  # the file names no device: castwise does not guess


def test_adam_bfloat16_skips_the_gradient_cast(tmp_path: Path) -> None:
    # SimpleTuner converts gradients to fp32 only when the optimizer is not adam_bfloat16
    env = tmp_path / "config.env"
    env.write_text(
        'export MIXED_PRECISION="bf16"\nexport OPTIMIZER="adam_bfloat16"\n'
        'export TRAINER_EXTRA_ARGS="--gradient_precision=fp32"\n'
    )
    assert codes(env) == []


def test_unmodified_gradient_precision_is_clean(tmp_path: Path) -> None:
    env = tmp_path / "config.env"
    env.write_text('export MIXED_PRECISION=bf16\nexport TRAINER_EXTRA_ARGS="--gradient_precision unmodified"\n')
    assert codes(env) == []


def test_trainer_extra_args_last_value_wins(tmp_path: Path) -> None:
    env = tmp_path / "config.env"
    env.write_text(
        "export MIXED_PRECISION=bf16\n"
        "export TRAINER_EXTRA_ARGS='--gradient_precision=fp32'\n"
        'export TRAINER_EXTRA_ARGS="${TRAINER_EXTRA_ARGS} --gradient_precision=unmodified"\n'
    )
    assert codes(env) == []
    env.write_text(
        "export MIXED_PRECISION=bf16\n"
        "export TRAINER_EXTRA_ARGS=''   # reset\n"
        'export TRAINER_EXTRA_ARGS="$TRAINER_EXTRA_ARGS --lora_rank=4"\n'
        'export TRAINER_EXTRA_ARGS="${TRAINER_EXTRA_ARGS} \\\n  --gradient_precision=fp32"\n'
    )
    (f,) = lint_config(env).findings
    assert f.locations[-1] == f"{env}:5"  # the continuation line where the argument is written


def test_shell_quoting_comments_and_defaults(tmp_path: Path) -> None:
    env = tmp_path / "config.env"
    env.write_text(
        "# a comment mentioning MIXED_PRECISION=fp16\n"
        "PRECISION_CHOICE=bf16\n"
        'export MIXED_PRECISION="${PRECISION_CHOICE:-fp16}"  # trailing comment\n'
        "export NOTE='single quotes keep ${PRECISION_CHOICE} literal'\n"
        "if [ -n \"$X\" ]; then echo 'skipped'; fi\n"
        'export TRAINER_EXTRA_ARGS="${EXTRA:---gradient_precision=fp32}"\n'
    )
    model = build_model(read_config(env))
    assert model.weights is not None and model.weights.value == "bfloat16"
    assert model.weights.settings[0].line == 3
    assert codes(env) == ["CW201"]


def test_quantised_base_uses_default_dtype(tmp_path: Path) -> None:
    env = tmp_path / "config.env"
    env.write_text(
        'export MIXED_PRECISION="bf16"\nexport BASE_MODEL_PRECISION="int8-quanto"\n'
        'export TRAINER_EXTRA_ARGS="--base_model_default_dtype=fp32 --gradient_precision=fp32"\n'
    )
    model = build_model(read_config(env))
    assert model.weights is not None and model.weights.value == "float32"
    assert codes(env) == []  # fp32 weights with fp32 gradients: consistent


def test_accelerate_deepspeed_file_resolved_beside_config_and_auto_filled() -> None:
    files = read_config(FIX / "accelerate" / "deepspeed_ok" / "default_config.yaml")
    assert [cf.format for cf in files] == ["accelerate", "deepspeed"]
    assert files[1].path.endswith("zero2.json")
    model = build_model(files)
    # "auto" filled from Accelerate's mixed_precision: bf16 weights in the DeepSpeed engine
    assert model.weights is not None and model.weights.value == "bfloat16"
    assert [s.name for s in model.weights.settings] == ["bf16.enabled", "mixed_precision"]
    assert model.optimizer_state is not None and model.optimizer_state.value == "float32"


def test_accelerate_deepspeed_mismatch_names_both_files() -> None:
    path = FIX / "accelerate" / "deepspeed_mismatch" / "default_config.yaml"
    (f,) = lint_config(path).findings
    assert f.settings == ("mixed_precision", "bf16.enabled")
    assert f.locations[0] == f"{path}:8"
    assert f.locations[1].endswith("ds_config.json:3")
    assert "auto" in (f.fix or "")


def test_accelerate_no_with_deepspeed_fp16_warns(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text('{"fp16": {"enabled": true}, "zero_optimization": {"stage": 1}}')
    cfg = tmp_path / "default_config.yaml"
    cfg.write_text(
        "distributed_type: DEEPSPEED\nmixed_precision: 'no'\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
    )
    (f,) = lint_config(cfg).findings
    assert (f.code, f.level) == ("CW203", "warning")


def test_two_files_linted_together(tmp_path: Path) -> None:
    # a DeepSpeed file given beside the Accelerate config (not pointed to by it)
    ds = tmp_path / "ds.json"
    ds.write_text('{"fp16": {"enabled": true}, "train_micro_batch_size_per_gpu": 1}')
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n")
    (f,) = lint_config([acc, ds]).findings
    assert f.code == "CW203" and {loc.rsplit(":", 1)[0] for loc in f.locations} == {str(acc), str(ds)}


def test_deepspeed_model_reads_loss_scale_and_comm_dtype() -> None:
    model = build_model(read_config(FIX / "deepspeed" / "zero2_fp16.json"))
    assert model.loss_scaling is not None and model.loss_scaling.value == "dynamic"
    assert model.reduce is not None and model.reduce.value == "float32"
    assert model.reduce.settings[0].name == "communication_data_type"
    model = build_model(read_config(FIX / "deepspeed" / "bf16_fp32_accum.json"))
    assert model.gradients is not None and model.gradients.value == "float32"
    assert model.gradient_mechanism == "accumulate"  # DeepSpeed's accumulation buffer: no CW201


def test_deepspeed_static_loss_scale_one_warns(tmp_path: Path) -> None:
    ds = tmp_path / "ds_config.json"
    ds.write_text('{\n  "fp16": {"enabled": true, "loss_scale": 1},\n  "zero_optimization": {"stage": 0}\n}\n')
    (f,) = lint_config(ds).findings
    assert (f.code, f.level) == ("CW206", "warning")
    assert "fp16.loss_scale" in f.settings


def test_lightning_bare_trainer_yaml_and_aliases(tmp_path: Path) -> None:
    cfg = tmp_path / "trainer.yaml"
    cfg.write_text("accelerator: cpu\ndevices: 1\nprecision: 16\n")
    (f,) = lint_config(cfg).findings
    assert (f.code, f.level, f.settings) == ("CW207", "warning", ("precision", "accelerator"))
    model = build_model(read_config(cfg))
    assert model.compute is not None and model.compute.value == "bfloat16"  # what Lightning runs


def test_lightning_deepspeed_strategy_keeps_fp32_master() -> None:
    import yaml

    from castwise.lint import lightning
    from castwise.lint._source import parse_yaml

    text = yaml.safe_dump({"trainer": {"strategy": "deepspeed_stage_2", "precision": "16-mixed"}})
    model = build_model([lightning.read(parse_yaml(text, "t.yaml"), "t.yaml")])
    assert model.weights is not None and model.weights.value == "float16"
    assert model.optimizer_state is not None and model.optimizer_state.value == "float32"


def test_hf_torch_dtype_float16_without_amp_warns(tmp_path: Path) -> None:
    cfg = tmp_path / "args.json"
    cfg.write_text('{"output_dir": "o", "model_init_kwargs": {"torch_dtype": "float16"}}')
    (f,) = lint_config(cfg).findings
    assert (f.code, f.settings) == ("CW206", ("model_init_kwargs.torch_dtype",))


def test_hf_inline_deepspeed_dict_mismatch(tmp_path: Path) -> None:
    cfg = tmp_path / "args.json"
    cfg.write_text('{\n "output_dir": "o",\n "fp16": true,\n "deepspeed": {\n  "bf16": {"enabled": true}\n }\n}\n')
    (f,) = lint_config(cfg).findings
    assert f.code == "CW208"
    assert f.settings == ("fp16", "deepspeed.bf16.enabled")
    assert f.locations == (f"{cfg}:3", f"{cfg}:5")


def test_hf_fp16_on_cpu_warns(tmp_path: Path) -> None:
    cfg = tmp_path / "args.json"
    cfg.write_text('{"output_dir": "o", "fp16": true, "use_cpu": true}')
    (f,) = lint_config(cfg).findings
    assert (f.code, f.level, f.settings) == ("CW207", "warning", ("fp16", "use_cpu"))


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text('{"bf16": {"enabled": true, "some_future_flag": [1, {"x": null}]}, "zzz": {"a": 1}}')
    assert codes(cfg) == []


def test_summary_carries_files_and_model() -> None:
    report = lint_config(FIX / "hf" / "with_ds" / "training_args.json")
    assert [f["format"] for f in report.summary["files"]] == ["hf-training-args", "deepspeed"]
    weights = report.summary["precision"]["weights"]
    assert weights["value"] == "float16"
    assert [s["name"] for s in weights["settings"]] == ["fp16.enabled", "fp16"]


def test_simpletuner_default_mixed_precision_is_bf16(tmp_path: Path) -> None:
    # SimpleTuner's --mixed_precision defaults to bf16: fp32 gradients still contradict it
    cfg = tmp_path / "config.json"
    cfg.write_text('{"--model_family": "flux", "--gradient_precision": "fp32"}')
    (f,) = lint_config(cfg).findings
    assert (f.code, f.settings) == ("CW201", ("--gradient_precision",))
    assert "default" in f.message


def test_hf_fsdp_reduces_in_the_amp_dtype(tmp_path: Path) -> None:
    cfg = tmp_path / "args.json"
    cfg.write_text('{"output_dir": "o", "bf16": true, "fsdp": "full_shard auto_wrap"}')
    model = build_model(read_config(cfg))
    assert model.reduce is not None and model.reduce.value == "bfloat16"
    assert [s.name for s in model.reduce.settings] == ["bf16", "fsdp"]
    assert lint_config(cfg).ok


def test_tf32_and_bf16_on_a_v100_instance_across_two_files(tmp_path: Path) -> None:
    acc = tmp_path / "default_config.yaml"
    acc.write_text(
        "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: 'NO'\n"
        "ec2_instance_type: ml.p3.8xlarge\nmixed_precision: 'no'\n"
    )
    args = tmp_path / "training_args.json"
    args.write_text('{"output_dir": "o", "bf16": true, "tf32": true}')
    findings = lint_config([acc, args]).findings
    assert sorted((f.code, f.settings) for f in findings) == [
        ("CW207", ("bf16", "ec2_instance_type")),
        ("CW207", ("tf32", "ec2_instance_type")),
    ]
    assert all(f.level == "error" for f in findings)


def test_bf16_on_an_a100_instance_is_clean(tmp_path: Path) -> None:
    acc = tmp_path / "default_config.yaml"
    acc.write_text("compute_environment: AMAZON_SAGEMAKER\nec2_instance_type: ml.p4d.24xlarge\nmixed_precision: bf16\n")
    model = build_model(read_config(acc))
    assert model.device is not None and model.device.value == "cuda:A100"
    assert lint_config(acc).ok and not lint_config(acc).findings


def test_lightning_deepspeed_strategy_config_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text('{"bf16": {"enabled": true}, "zero_optimization": {"stage": 3}}')
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(
        "trainer:\n  precision: bf16-mixed\n  strategy:\n"
        "    class_path: lightning.pytorch.strategies.DeepSpeedStrategy\n"
        "    init_args:\n      stage: 3\n      config: ds.json\n"
    )
    files = read_config(cfg)
    assert [cf.format for cf in files] == ["lightning", "deepspeed"]
    assert lint_config(cfg).findings == []
    model = build_model(files)
    assert model.weights is not None and model.weights.value == "bfloat16"
    # 16-mixed with a bf16 block: Lightning adds fp16, DeepSpeed refuses both
    cfg.write_text(cfg.read_text().replace("bf16-mixed", "16-mixed"))
    (f,) = lint_config(cfg).findings
    assert (f.code, f.settings) == ("CW209", ("trainer.precision", "bf16.enabled"))


def test_lightning_inline_deepspeed_dict_disabled_block_warns(tmp_path: Path) -> None:
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(
        "trainer:\n  precision: 16-mixed\n  strategy:\n"
        "    class_path: lightning.pytorch.strategies.DeepSpeedStrategy\n"
        "    init_args:\n      config:\n        fp16:\n          enabled: false\n"
    )
    (f,) = lint_config(cfg).findings
    assert (f.code, f.level) == ("CW209", "warning")
    assert f.settings == ("trainer.precision", "trainer.strategy.init_args.config.fp16.enabled")
    assert f.locations[1] == f"{cfg}:8"


def test_a_simpletuner_launch_script_by_any_name_is_read_and_the_render_says_as_what(tmp_path: Path) -> None:
    from castwise.lint import render

    script = tmp_path / "train_flux.sh"
    script.write_text('#!/bin/bash\nexport MODEL_FAMILY="flux"\nexport MIXED_PRECISION="fp16"\n', encoding="utf-8")
    report = lint_config(script)
    assert report.summary["files"] == [{"path": str(script), "format": "simpletuner"}]
    assert build_model(read_config(script)).compute is not None
    text = render(report, 100)
    assert "read: train_flux.sh as SimpleTuner config (config.env, config.json, config.toml)" in text


def test_the_render_names_the_format_of_every_file() -> None:
    from castwise.lint import render

    text = render(lint_config(FIX / "accelerate" / "deepspeed_ok" / "default_config.yaml"), 100)
    assert "default_config.yaml as Accelerate config" in text and "as DeepSpeed config (JSON)" in text
