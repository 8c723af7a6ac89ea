"""The root causes of mixed-precision dtype failures (torch-free).

Drawn from maintainers' diagnoses of real reports in public issue trackers. Every diagnostic
rule, audit finding and explanation names one of these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Category:
    id: str
    title: str
    description: str


_ROWS: tuple[tuple[str, str, str], ...] = (
    (
        "AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL",
        "fp32 output of autocast reaches a kernel that demands fp16/bf16",
        "Autocast runs some ops in float32 (layer_norm, softmax on CUDA), fp32 norm parameters or "
        "fp32 RoPE tables promote activations, and the result flows into a kernel that is not "
        "autocast-aware and needs fp16/bf16 or identical q/k/v dtypes (flash-attn, xFormers, "
        "Triton or apex fused ops).",
    ),
    (
        "UNCAST_CUSTOM_OP_OR_EXTENSION",
        "custom op or extension runs without autocast casting",
        "A C++/CUDA extension, Triton kernel or autograd.Function runs inside autocast without "
        "custom_fwd(cast_inputs=...), so it receives the raw mix of half activations and fp32 "
        "parameters, or only implements float32.",
    ),
    (
        "FASTPATH_BYPASSES_AUTOCAST",
        "fused fast path ignores autocast",
        "TransformerEncoderLayer / MultiheadAttention fused kernels are taken in eval/no_grad and "
        "bypass autocast (the gate checks autocast only for CUDA): training works, validation or "
        "inference fails.",
    ),
    (
        "MODEL_INPUT_DTYPE_MISMATCH",
        "model weights and inputs in different dtypes",
        "Weights cast with .half()/.bfloat16()/torch_dtype while inputs, latents or caches stay "
        "float32 (or the reverse), with no autocast to reconcile them.",
    ),
    (
        "KEEP_FP32_MODULE_LEAK",
        "a module kept in fp32 leaks fp32 into the half-precision stream",
        "Modules intentionally kept in float32 (transformers _keep_in_fp32_modules such as T5 wo, "
        "upcast norms, fp32 towers) emit float32 activations that spread through the residual "
        "stream and reach a strict consumer.",
    ),
    (
        "KEEP_FP32_MODULE_DOWNCAST",
        "a module designed to run in fp32 was cast to half precision",
        "A blanket model.to(bf16/fp16) casts a layer that upcasts its input to float32 "
        "(LayerNormFp32, fp32 norm wrappers): the float32 input meets low-precision weights.",
    ),
    (
        "UNCONVERTED_TENSOR_OR_BUFFER",
        "a tensor outside Module.to()'s reach kept its dtype",
        "Plain tensor attributes, tensors created in forward with the default dtype (timestep "
        "tables, arange, masks), buffers skipped by a wrapper, weights built inside custom modules.",
    ),
    (
        "STRICT_SAME_DTYPE_OP",
        "an op that requires identical dtypes got two",
        "index_put, masked_scatter, scatter, in-place lerp_/add_, dot and cat under CPU autocast are "
        "not autocast-promoted and refuse mixed dtypes, typically when writing features into fp32 "
        "embeddings or preallocated buffers.",
    ),
    (
        "MASK_DTYPE_MISMATCH",
        "attention mask or bias in a different dtype than the query",
        "Attention masks or biases built in another floating dtype than the query (fp32 additive "
        "bias with bf16 q, bf16 mask with fp16 q).",
    ),
    (
        "ADAPTER_DTYPE_MISMATCH",
        "adapter weights in a different dtype than the base layer",
        "LoRA/PEFT/adapter weights in another dtype than the base layer or its inputs, typically "
        "at inference/generate outside autocast or in custom fused adapter kernels.",
    ),
    (
        "QUANT_COMPUTE_DTYPE_MISMATCH",
        "quantised layers compute in a different dtype than their neighbours",
        "bitsandbytes/quanto/unsloth dequantise or compute in a dtype (bnb_4bit_compute_dtype, "
        "quant_state.dtype) different from the non-quantised layers around them.",
    ),
    (
        "GRADSCALER_LOW_PRECISION_PARAMS",
        "GradScaler used with half-precision parameters",
        "fp16 loss scaling (GradScaler) while trainable parameters, and so gradients, are fp16 or "
        "bf16 instead of fp32 master weights.",
    ),
    (
        "OPTIMIZER_OR_GRAD_DTYPE",
        "gradient or optimizer state dtype differs from the parameters",
        "fp32 gradient precision with bf16 weights, fp32 optimizer states updated from bf16 grads, "
        "bf16-only optimizers given fp32 params, grads of one half type meeting weights of another.",
    ),
    (
        "NORM_PARAM_OR_STATS_DTYPE",
        "norm weights or running statistics in a different dtype than the input",
        "BatchNorm/GroupNorm/LayerNorm weights or running stats in another dtype than the input "
        "(BN kept fp32 by half converters, half buffers updated with fp32 stats, CPU mixed-dtype "
        "norm kernels).",
    ),
    (
        "TORCH_COMPILE_DTYPE",
        "torch.compile handles dtypes differently from eager",
        "torch.compile/inductor/AOTAutograd treat autocast, default dtype or type promotion "
        "differently from eager, so an error appears only compiled (or only eager).",
    ),
    (
        "DISTRIBUTED_PRECISION_CONFIG",
        "distributed or trainer precision settings contradict each other",
        "DeepSpeed/FSDP/Accelerate/Lightning precision settings that cast parameters but not "
        "inputs or buffers, disagree with each other, or disagree with the checkpoint's dtype.",
    ),
    (
        "FP16_RANGE_OVERFLOW",
        "values exceed float16's range",
        "Activations overflow float16's 65504 to inf/NaN (T5 FFN, SDXL VAE), or constants such as "
        "-1e9 are written into fp16 tensors.",
    ),
    (
        "UNSAFE_OR_LOWPREC_LOSS",
        "loss computed in low precision or with an autocast-unsafe op",
        "binary_cross_entropy on probabilities under autocast, or loss/target dtype mismatches in "
        "backward under pure half training.",
    ),
    (
        "DTYPE_UNSUPPORTED_ON_DEVICE",
        "no kernel for this dtype on this device",
        "fp16 kernels missing on old CPU builds, bf16 on pre-Ampere GPUs, autocast dtype limits, "
        "complex bf16, flash-attn given float32.",
    ),
    # silent problems: no exception, only wrong numbers (a loss that stalls, gradients that vanish,
    # outputs that drift from fp32). Overflow to inf/NaN stays FP16_RANGE_OVERFLOW.
    (
        "LOSS_SCALE_OR_UNDERFLOW",
        "fp16 gradients underflow or the loss scale collapses",
        "Silent: small values flush to zero in fp16 (gradients, Adam's eps) or the loss scale keeps "
        'shrinking ("Gradient overflow. Skipping step" on every step, "Current loss scale already at '
        'minimum"): training stalls or the loss stops moving without any error.',
    ),
    (
        "LOWPREC_ROUNDING",
        "bf16/fp16 rounding loses precision the computation needs",
        "Silent: values are representable but too coarse in bf16/fp16 (accumulations, positions in "
        "RoPE, small weight updates, softmax/logits, eval in half): results drift from fp32, the "
        "loss plateaus or outputs differ between precisions, with no error raised.",
    ),
)

CATEGORIES: dict[str, Category] = {row[0]: Category(*row) for row in _ROWS}


def get(category_id: str) -> Category:
    try:
        return CATEGORIES[category_id]
    except KeyError:
        raise KeyError(f"unknown category {category_id!r}; valid: {', '.join(sorted(CATEGORIES))}") from None
