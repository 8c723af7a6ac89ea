"""CW212: FP8 training on hardware or a launcher without FP8 (castwise.lint.fp8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from castwise.lint import lint_config


def _codes(tmp_path: Path, name: str, text: str) -> list[str]:
    path = tmp_path / name
    path.write_text(text)
    return [f.code for f in lint_config([path]).findings]


SAGEMAKER = "compute_environment: AMAZON_SAGEMAKER\nec2_instance_type: {}\nmixed_precision: {}\n"


@pytest.mark.parametrize(("instance", "gpu"), [("ml.p4d.24xlarge", "A100"), ("ml.g5.12xlarge", "A10G")])
def test_accelerate_fp8_needs_compute_capability_8_9(tmp_path: Path, instance: str, gpu: str) -> None:
    path = tmp_path / "default_config.yaml"
    path.write_text(SAGEMAKER.format(instance, "fp8"))
    (finding,) = lint_config([path]).findings
    assert finding.code == "CW212" and finding.settings == ("mixed_precision", "ec2_instance_type")
    assert f"runs on {gpu} GPUs (compute capability 8." in finding.message
    assert "FP8 needs 8.9 or newer" in finding.message and "bf16" in finding.fix
    # the same machine in bf16, and fp8 on FP8 GPUs (H100, L4), are fine
    assert _codes(tmp_path, "bf16.yaml", SAGEMAKER.format(instance, "bf16")) == []
    assert _codes(tmp_path, "h100.yaml", SAGEMAKER.format("ml.p5.48xlarge", "fp8")) == []
    assert _codes(tmp_path, "l4.yaml", SAGEMAKER.format("ml.g6.xlarge", "fp8")) == []


@pytest.mark.parametrize("precision", ["transformer-engine", "transformer-engine-float16"])
def test_lightning_transformer_engine_on_cpu(tmp_path: Path, precision: str) -> None:
    text = f"trainer:\n  accelerator: cpu\n  precision: {precision}\n"
    assert _codes(tmp_path, "trainer.yaml", text) == ["CW212"]
    assert _codes(tmp_path, "gpu.yaml", text.replace("cpu", "gpu")) == []  # which GPU: not said


def test_accelerate_fp8_on_cpu_and_tpu(tmp_path: Path) -> None:
    cpu = "compute_environment: LOCAL_MACHINE\nuse_cpu: true\nmixed_precision: fp8\n"
    assert _codes(tmp_path, "cpu.yaml", cpu) == ["CW212"]
    tpu = "compute_environment: LOCAL_MACHINE\ndistributed_type: XLA\nmixed_precision: fp8\n"
    assert _codes(tmp_path, "tpu.yaml", tpu) == ["CW212"]
