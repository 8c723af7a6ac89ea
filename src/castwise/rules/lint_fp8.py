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
    Rule(
        code="CW213",
        name="fp8-setting-ignored",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="warning",
        summary="A float8 recipe setting that no code reads: the run uses the default instead.",
        detects="Accelerate fp8_config keys accelerate launch passes under names TransformerEngine's "
        "recipe never reads (amax_history_length, amax_compute_algorithm: what accelerate config writes), "
        "a TransformerEngine key under backend: AO or a torchao key under backend: TE, fp8_config without "
        "mixed_precision: fp8; a torchtitan [quantize.linear.float8] / [quantize.linear.mx] section whose "
        "converter [model] converters does not list, precompute_float8_dynamic_scale_for_fsdp without "
        "the float8 all-gather; a Megatron-LM --fp8-recipe / --fp4-recipe (or a Megatron-Bridge "
        "mixed_precision.fp8_recipe) without --fp8-format / --fp4-format, which alone turn the GEMMs on.",
        why="Nothing fails: the setting is dropped on the way (an environment variable nobody reads, a "
        "section no converter is built for) and the run trains with the recipe's defaults (an amax "
        "history of 1024 with most_recent, not what the file says) or without float8 at all.",
        example="mixed_precision: fp8\nfp8_config:\n  backend: TE\n  amax_history_length: 16",
        fix="Rename the key to the one the recipe reads (amax_history_len, amax_compute_algo), set the "
        'backend the key belongs to, or list the converter (converters = ["quantize.linear.float8"]).',
    ),
    Rule(
        code="CW214",
        name="fp8-settings-refused",
        category="DISTRIBUTED_PRECISION_CONFIG",
        severity="error",
        summary="Float8 settings the launcher refuses at start (a conflict, or a recipe key it does not take).",
        detects="torchtitan: a rowwise recipe_name with enable_fsdp_float8_all_gather = true (float8 "
        "all-gather needs tensorwise scales), or a float8 and an MX converter both in [model] converters. "
        "Lightning: a TransformerEnginePrecision recipe key DelayedScaling does not take "
        "(amax_history_length), or an fp8_format that is not a Format name (HYBRID, E4M3, E5M2: 'hybrid' "
        "fails).",
        why="torchtitan asserts 'using enable_fsdp_float8_all_gather together with recipe_name is not "
        "supported' when it builds the model, and Lightning builds DelayedScaling(**recipe) when the "
        "Trainer is made: the job fails after it was scheduled and the GPUs allocated; two converters "
        "both try to swap the same Linears.",
        example='[model]\nconverters = ["quantize.linear.float8"]\n[quantize.linear.float8]\n'
        'recipe_name = "rowwise"\nenable_fsdp_float8_all_gather = true',
        fix="Turn the float8 all-gather off for rowwise scaling (or use tensorwise to keep it); keep one of "
        "the float8 and MX converters; write the recipe with DelayedScaling's own keys and Format names.",
    ),
)
