"""CW220: a precision setting whose value has the wrong type, or is not one the tool takes, is a
finding naming the setting, the value and the valid values; it never passes silently, and the
precision model does not act on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from castwise.lint import build_model, lint_config, read_config

DS_MARKERS = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def only_cw220(path: Path) -> tuple[str, str, str]:
    findings = lint_config(path).findings
    assert [f.code for f in findings] == ["CW220"], [f.code for f in findings]
    (f,) = findings
    assert f.level == "error" and len(f.settings) == len(f.locations) == 1
    return f.settings[0], f.locations[0], f.message


def test_deepspeed_enabled_that_is_not_a_boolean(tmp_path: Path) -> None:
    path = write(tmp_path, "ds_config.json", json.dumps({"fp16": {"enabled": "yes please"}, **DS_MARKERS}, indent=1))
    setting, location, message = only_cw220(path)
    assert (setting, location) == ("fp16.enabled", f"{path}:3")
    assert (
        message
        == f'fp16.enabled="yes please" ({path}:3) is not a value this setting takes; valid: "auto", false, true.'
    )


def test_training_arguments_flag_that_is_a_list(tmp_path: Path) -> None:
    path = write(tmp_path, "training_args.yaml", "output_dir: out\nper_device_train_batch_size: 8\nbf16: [1, 2]\n")
    setting, location, message = only_cw220(path)
    assert (setting, location) == ("bf16", f"{path}:3")
    assert message.startswith("bf16=[1, 2] (")
    assert "any non-empty string or list counts as true" in message and message.endswith("valid: false, true.")
    # the model does not read the list as "bf16 on" (nor as off: it is not set)
    assert build_model(read_config(path)).compute is None


def test_lightning_precision_that_is_a_list(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer.yaml", "trainer:\n  accelerator: gpu\n  precision: [1, 2]\n")
    setting, location, message = only_cw220(path)
    assert (setting, location) == ("trainer.precision", f"{path}:3")
    assert message.startswith("trainer.precision=[1, 2] (")
    valid = message.rsplit("valid: ", 1)[1].rstrip(".").split(", ")
    assert {"16-mixed", "bf16-mixed", "32-true", "transformer-engine"} <= set(valid) and valid == sorted(valid)


@pytest.mark.parametrize(
    ("name", "text", "setting"),
    [
        ("trainer.yaml", "trainer:\n  precision: bf17-mixed\n", "trainer.precision"),
        ("trainer.yaml", "trainer:\n  precision: true\n", "trainer.precision"),
        ("default_config.yaml", "distributed_type: MULTI_GPU\nmixed_precision: fp12\n", "mixed_precision"),
        ("training_args.json", '{"output_dir": "o", "fp16": "false"}', "fp16"),
        ("training_args.json", '{"output_dir": "o", "half_precision_backend": "turbo"}', "half_precision_backend"),
        ("ds_config.json", '{"bf16": true, "zero_optimization": {"stage": 2}}', "bf16"),
        ("config.json", '{"--mixed_precision": "bf16", "--gradient_precision": "fp64"}', "--gradient_precision"),
    ],
)
def test_other_values_the_tools_do_not_take(tmp_path: Path, name: str, text: str, setting: str) -> None:
    got, _, _ = only_cw220(write(tmp_path, name, text))
    assert got == setting


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "ds_config.json",
            '{"fp16": {"enabled": "auto"}, "bf16": {"enabled": false}, "zero_optimization": {"stage": 2}}',
        ),
        ("ds_config.json", '{"bf16": {"enabled": "true"}, "zero_optimization": {"stage": 2}}'),
        ("trainer.yaml", "trainer:\n  precision: 16\n"),
        ("trainer.yaml", "trainer:\n  precision: bf16\n  devices: [0, 1]\n"),
        ("trainer.yaml", "trainer:\n  precision: transformer-engine\n"),
        ("default_config.yaml", "distributed_type: MULTI_GPU\nmixed_precision: no\nuse_cpu: false\n"),
        ("training_args.json", '{"output_dir": "o", "bf16": true, "tf32": null, "fsdp": ["full_shard", "auto_wrap"]}'),
    ],
)
def test_values_the_tools_take_are_not_reported(tmp_path: Path, name: str, text: str) -> None:
    findings = lint_config(write(tmp_path, name, text)).findings
    assert [f.code for f in findings if f.code == "CW220"] == []
