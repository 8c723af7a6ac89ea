"""Rules lint-config reports for FP8 training settings (CW212+)."""

from __future__ import annotations

from castwise.rules._rule import Rule

RULES: tuple[Rule, ...] = (
    Rule(
        code="CW212",
        name="fp8-unsupported-on-device",
        category="DTYPE_UNSUPPORTED_ON_DEVICE",
        severity="error",
        summary="FP8 training asked for on hardware or a launcher without FP8.",
        detects="A float8 precision (Accelerate / SimpleTuner mixed_precision: fp8, Lightning "
        "precision: transformer-engine or transformer-engine-float16) while the configuration "
        "names a GPU below compute capability 8.9 (A100, A10G, V100, T4: e.g. a SageMaker "
        "ml.p4d / ml.g5 / ml.p3 instance), or runs on CPU, TPU/XLA or MPS (use_cpu, MULTI_CPU, "
        "distributed_type XLA, accelerator: cpu).",
        why="float8 matmuls (torch._scaled_mm, TransformerEngine's FP8 GEMMs) need FP8 tensor cores: "
        "Ada (sm_89) and Hopper (sm_90) or newer; MX formats need Blackwell (sm_100). On an A100 "
        "torchao's Float8Linear fails in _scaled_mm ('torch._scaled_mm is only supported on CUDA "
        "devices with compute capability >= 9.0 or 8.9'), TransformerEngine refuses fp8_autocast "
        "('Device compute capability 8.9 or higher required for FP8 execution'), and on CPU or TPU "
        "there is no FP8 path at all. The job fails after it was scheduled, or, where a backend "
        "falls back, trains in another precision than the file says.",
        example="compute_environment: AMAZON_SAGEMAKER\nec2_instance_type: ml.p4d.24xlarge\nmixed_precision: fp8",
        fix="Use bf16 on that machine (mixed_precision: bf16, precision: bf16-mixed), or move the run "
        "to an FP8 GPU (L4, L40S, H100, H200, B200: a SageMaker ml.g6 / ml.g6e / ml.p5 instance).",
    ),
)
