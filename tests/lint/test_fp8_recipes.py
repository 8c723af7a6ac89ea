"""CW213 / CW214 and CW220 for float8 recipe settings: Accelerate's fp8_config (TransformerEngine
and torchao keys), torchtitan's float8 / MX converters (castwise.lint.fp8_recipes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from castwise.lint import build_model, lint_config, read_config

FIXTURES = Path(__file__).parent / "fixtures"


def _findings(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    return [(f.code, f.settings) for f in lint_config([path]).findings]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_what_accelerate_config_writes_for_te_reaches_no_recipe() -> None:
    found = _findings(FIXTURES / "accelerate" / "fp8_te_accelerate_config.yaml")
    assert found == [
        ("CW213", ("fp8_config.amax_history_length",)),
        ("CW213", ("fp8_config.amax_compute_algorithm",)),
    ]
    report = lint_config([FIXTURES / "accelerate" / "fp8_te_accelerate_config.yaml"])
    assert "ACCELERATE_FP8_AMAX_HISTORY_LEN" in report.findings[0].message
    assert report.findings[0].fix.startswith("Rename fp8_config.amax_history_length to fp8_config.amax_history_len")


def test_accelerate_fp8_keys_of_the_other_backend_and_without_fp8(tmp_path: Path) -> None:
    head = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n"
    ao = _write(tmp_path, "ao.yaml", head + "mixed_precision: fp8\nfp8_config:\n  backend: AO\n  fp8_format: E4M3\n")
    assert _findings(ao) == [("CW213", ("fp8_config.fp8_format", "fp8_config.backend"))]
    bf16 = _write(tmp_path, "bf16.yaml", head + "mixed_precision: bf16\nfp8_config:\n  backend: AO\n")
    assert _findings(bf16) == [("CW213", ("fp8_config.backend", "mixed_precision"))]
    good = head + "mixed_precision: fp8\nfp8_config:\n  backend: TE\n  fp8_format: HYBRID\n  amax_history_len: 16\n"
    assert _findings(_write(tmp_path, "good.yaml", good)) == []
    bad = _write(tmp_path, "bad.yaml", good.replace("HYBRID", "E3M4").replace("TE\n", "te\n"))
    assert _findings(bad) == [("CW220", ("fp8_config.fp8_format",))]  # backend te: accelerate upper-cases it


def test_torchtitan_float8_config_lints_clean_and_reads_its_precision() -> None:
    path = FIXTURES / "torchtitan" / "llama3_8b_float8.toml"
    assert lint_config([path]).findings == []
    (cf,) = read_config(path)
    assert cf.format == "torchtitan"
    assert cf.get("quantize.linear.float8.filter_fqns") is not None
    assert cf.settings["quantize.linear.float8.enable_fsdp_float8_all_gather"].line == 12
    assert lint_config([FIXTURES / "torchtitan" / "mxfp8_b200.toml"]).findings == []


def test_torchtitan_conflicts_and_wrong_values() -> None:
    found = _findings(FIXTURES / "torchtitan" / "float8_conflicts.toml")
    assert found == [
        ("CW214", ("model.converters",)),
        (
            "CW214",
            ("quantize.linear.float8.recipe_name", "quantize.linear.float8.enable_fsdp_float8_all_gather"),
        ),
        ("CW220", ("training.mixed_precision_param",)),
    ]


def test_torchtitan_sections_no_converter_reads(tmp_path: Path) -> None:
    assert _findings(FIXTURES / "torchtitan" / "float8_not_converted.toml") == [
        ("CW213", ("float8", "model.converters"))
    ]
    text = (
        '[model]\nconverters = ["float8"]\n[float8]\nprecompute_float8_dynamic_scale_for_fsdp = true\n'
        'recipe_name = "rowwise_with_gw_hp"\n'
    )
    assert _findings(_write(tmp_path, "job.toml", text)) == [
        ("CW213", ("float8.precompute_float8_dynamic_scale_for_fsdp",))
    ]
    assert _findings(_write(tmp_path, "typo.toml", text.replace("rowwise_with_gw_hp", "colwise"))) == [
        ("CW213", ("float8.precompute_float8_dynamic_scale_for_fsdp",)),
        ("CW220", ("float8.recipe_name",)),
    ]


def test_lightning_transformer_engine_recipe_keys_and_format() -> None:
    path = FIXTURES / "lightning" / "te_recipe.yaml"
    report = lint_config([path])
    assert [(f.code, f.settings) for f in report.findings] == [
        ("CW214", ("trainer.plugins.init_args.recipe.fp8_format",)),
        ("CW214", ("trainer.plugins.init_args.recipe.amax_history_length",)),
    ]
    assert "Format enum" in report.findings[0].message and report.findings[1].fix == "Rename it to amax_history_len."
    assert report.findings[0].locations == (f"{path}:9",)


def test_a_transformer_engine_recipe_delayed_scaling_takes_is_clean(tmp_path: Path) -> None:
    text = (FIXTURES / "lightning" / "te_recipe.yaml").read_text()
    good = text.replace("hybrid", "HYBRID").replace("amax_history_length", "amax_history_len")
    assert _findings(_write(tmp_path, "trainer.yaml", good)) == []


_PRETRAIN = "torchrun pretrain_gpt.py --tensor-model-parallel-size 2 {}\n"


def test_a_megatron_fp8_recipe_without_a_format_is_never_read(tmp_path: Path) -> None:
    # Megatron builds no fp8 recipe without --fp8-format (args.fp8 None): --fp8-recipe is inert
    inert = _write(tmp_path, "inert.sh", _PRETRAIN.format("--bf16 --fp8-recipe mxfp8"))
    report = lint_config([inert])
    assert [(f.code, f.settings) for f in report.findings] == [("CW213", ("--fp8-recipe",))]
    assert "without --fp8-format" in report.findings[0].message
    assert report.findings[0].fix.startswith("Add --fp8-format")
    # look-alikes that stay clean: the format given, and a plain bf16 run
    for flags in (
        "--bf16 --fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather",
        "--bf16",
        "--bf16 --fp4-format e2m1",
    ):
        assert _findings(_write(tmp_path, "ok.sh", _PRETRAIN.format(flags))) == []


@pytest.mark.parametrize(
    ("flags", "compute"),
    [
        ("--bf16 --fp8-format hybrid --fp8-recipe tensorwise", "float8_e4m3fn"),
        ("--bf16 --fp4-format e2m1 --fp4-recipe nvfp4", "float4_e2m1fn_x2"),
        ("--bf16 --fp8-recipe mxfp8", "bfloat16"),
        ("--bf16 --fp8-hybrid", "float8_e4m3fn"),  # Megatron-LM before 2023-08
    ],
)
def test_megatron_gemm_flags_set_what_the_linears_compute_in(tmp_path: Path, flags: str, compute: str) -> None:
    model = build_model(read_config(_write(tmp_path, "run.sh", _PRETRAIN.format(flags))))
    assert model.compute is not None and model.compute.value == compute


def test_a_torchtitan_recipe_name_its_converter_refuses(tmp_path: Path) -> None:
    toml = '[model]\nconverters = ["{}"]\n[{}]\nrecipe_name = "{}"\n'
    bad = _write(tmp_path, "bad.toml", toml.format("quantize.linear.mx", "quantize.linear.mx", "mxfp8_cublass"))
    report = lint_config([bad])
    assert [(f.code, f.settings) for f in report.findings] == [("CW220", ("quantize.linear.mx.recipe_name",))]
    assert "mxfp8_cublas" in report.findings[0].message  # the valid names are listed
    # look-alikes: a valid recipe, and an MX Linear converter beside a float8 grouped-GEMM one
    good = _write(tmp_path, "good.toml", toml.format("quantize.linear.mx", "quantize.linear.mx", "mxfp4_cutlass"))
    assert _findings(good) == []
    model = build_model(read_config(good))
    assert model.compute is not None and model.compute.value == "float4_e2m1fn_x2"
    both = '[model]\nconverters = ["quantize.linear.mx", "quantize.grouped_mm.float8"]\n'
    assert _findings(_write(tmp_path, "both.toml", both)) == []


_BRIDGE_YAML = "model:\n  tensor_model_parallel_size: 2\ntrain:\n  global_batch_size: 8\nmixed_precision:{}\n"


@pytest.mark.parametrize(
    ("mixed_precision", "weights", "compute"),
    [
        (" bf16_with_mxfp8_mixed", "bfloat16", "float8_e4m3fn"),
        (" bf16-with-nvfp4-mixed", "bfloat16", "float4_e2m1fn_x2"),
        (" fp16_mixed", "float16", "float16"),
        ("\n  bf16: true\n  fp8: hybrid\n  fp8_recipe: tensorwise\n", "bfloat16", "float8_e4m3fn"),
        ("\n  bf16: true\n  fp4: e2m1\n", "bfloat16", "float4_e2m1fn_x2"),
    ],
)
def test_a_megatron_bridge_config_reads_its_mixed_precision(
    tmp_path: Path, mixed_precision: str, weights: str, compute: str
) -> None:
    path = _write(tmp_path, "config.yaml", _BRIDGE_YAML.format(mixed_precision))
    (cf,) = read_config(path)
    assert cf.format == "megatron-bridge"
    model = build_model([cf])
    assert model.weights is not None and model.weights.value == weights
    assert model.compute is not None and model.compute.value == compute
    assert lint_config([path]).findings == []


def test_a_megatron_bridge_fp8_recipe_without_fp8_and_an_unknown_name(tmp_path: Path) -> None:
    inert = _write(tmp_path, "inert.yaml", _BRIDGE_YAML.format("\n  bf16: true\n  fp8_recipe: mxfp8\n"))
    report = lint_config([inert])
    assert [(f.code, f.settings) for f in report.findings] == [("CW213", ("mixed_precision.fp8_recipe",))]
    assert report.findings[0].fix.startswith("Set mixed_precision.fp8")
    unknown = _write(tmp_path, "unknown.yaml", _BRIDGE_YAML.format(" bf16_with_fp8_mixed"))  # NeMo 2's name
    assert [f.code for f in lint_config([unknown]).findings] == ["CW220"]
