"""What to tell the user per root cause: the cause in plain words and the fixes (torch-free)."""

from __future__ import annotations

CAUSES: dict[str, str] = {
    "AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL": (
        "An op that autocast (or the model) runs in float32 - layer_norm/rms_norm/softmax under CUDA "
        "autocast, float32 norm weights, float32 RoPE tables - returned float32, and that tensor reached "
        "a kernel that is not autocast-aware and takes only fp16/bf16 or identical q/k/v dtypes."
    ),
    "UNCAST_CUSTOM_OP_OR_EXTENSION": (
        "A custom op (C++/CUDA extension, Triton kernel or autograd.Function) ran inside autocast without "
        "casting its inputs, so it received half-precision activations together with float32 parameters."
    ),
    "FASTPATH_BYPASSES_AUTOCAST": (
        "nn.TransformerEncoderLayer / nn.MultiheadAttention took their fused C++ fast path (eval mode, "
        "no_grad), which does not apply autocast: autocast's low-precision activations met float32 "
        "weights. Training runs the Python path and works; validation or inference fails."
    ),
    "MODEL_INPUT_DTYPE_MISMATCH": (
        "The model's weights and its inputs are in different dtypes (the model was cast with "
        ".half()/.bfloat16()/torch_dtype, the inputs were not, or the reverse) and no autocast "
        "reconciles them."
    ),
    "KEEP_FP32_MODULE_LEAK": (
        "A module kept in float32 on purpose (transformers' _keep_in_fp32_modules such as T5's wo, "
        "upcast norms, an fp32 tower) returned float32 into the half-precision stream, and a later "
        "op that needs one dtype refused it."
    ),
    "KEEP_FP32_MODULE_DOWNCAST": (
        "A module written to compute in float32 (it casts its input up, like OpenCLIP's LayerNormFp32) "
        "had its weights cast to half precision by a blanket model.to(dtype): its float32 input meets "
        "low-precision weights."
    ),
    "UNCONVERTED_TENSOR_OR_BUFFER": (
        "A tensor outside Module.to()'s reach kept its dtype: a plain tensor attribute, a tensor created "
        "in forward with the default dtype (timestep tables, arange, masks), or a buffer or weight a "
        "wrapper skipped."
    ),
    "STRICT_SAME_DTYPE_OP": (
        "An op that requires identical dtypes and is not autocast-promoted (index_put, masked_scatter, "
        "scatter, in-place updates, dot) received two dtypes, typically writing low-precision features "
        "into a float32 tensor."
    ),
    "MASK_DTYPE_MISMATCH": "An attention mask or bias was built in a different floating dtype than the query.",
    "ADAPTER_DTYPE_MISMATCH": (
        "Adapter (LoRA/PEFT) weights are in a different dtype than the base layer or its input, which "
        "shows outside autocast (generate, evaluation) or in fused adapter kernels."
    ),
    "QUANT_COMPUTE_DTYPE_MISMATCH": (
        "Quantised layers compute (dequantise) in a different dtype than the layers around them "
        "(bnb_4bit_compute_dtype, quant_state.dtype, the model's torch_dtype disagree)."
    ),
    "GRADSCALER_LOW_PRECISION_PARAMS": (
        "A GradScaler (fp16 loss scaling) is used while the trainable parameters, and so their "
        "gradients, are fp16/bf16 instead of float32 master weights."
    ),
    "OPTIMIZER_OR_GRAD_DTYPE": (
        "A gradient or optimizer state has a different dtype than its parameter: float32 gradient "
        "precision with bf16 weights, float32 states updated from bf16 gradients, or a hook that "
        "changes a gradient's dtype."
    ),
    "NORM_PARAM_OR_STATS_DTYPE": (
        "A normalisation layer's weights or running statistics are in a different dtype than its input "
        "(BatchNorm kept float32 by a half converter, half buffers, CPU norm kernels that refuse the mix)."
    ),
    "TORCH_COMPILE_DTYPE": (
        "torch.compile (dynamo/inductor/AOTAutograd) treats autocast or type promotion differently from "
        "eager, so the dtypes differ only in the compiled graph."
    ),
    "DISTRIBUTED_PRECISION_CONFIG": (
        "The training framework's precision settings (DeepSpeed, FSDP MixedPrecision, Accelerate, "
        "Lightning) cast parameters but not inputs or buffers, cast to the other half type, or disagree "
        "with each other or with the checkpoint."
    ),
    "FP16_RANGE_OVERFLOW": (
        "Values exceed float16's range (max 65504): activations overflow to inf/NaN, or a constant such "
        "as -1e9 is written into a float16 tensor."
    ),
    "UNSAFE_OR_LOWPREC_LOSS": (
        "The loss runs in low precision or uses an op autocast refuses (binary_cross_entropy on "
        "probabilities), or loss and target dtypes disagree."
    ),
    "DTYPE_UNSUPPORTED_ON_DEVICE": (
        "This device (or this torch build) has no kernel for the op in this dtype: bf16 on pre-Ampere "
        "GPUs, fp16 on old CPU builds, CPU autocast dtype limits, complex bf16."
    ),
    "LOSS_SCALE_OR_UNDERFLOW": (
        "A silent fp16 problem: values too small for float16 flush to zero (gradients, Adam's eps in fp16 "
        "parameters), or the gradients overflow on every step so the dynamic loss scaler keeps skipping "
        "steps and shrinking the scale until nothing trains."
    ),
    "LOWPREC_ROUNDING": (
        "A silent precision problem: the values fit bf16/fp16 but their 8 (bf16) or 11 (fp16) mantissa "
        "bits are too coarse for what is computed in them - RoPE positions, accumulated losses or metrics, "
        "small weight or EMA updates, eval in half - so results drift from fp32 without any error."
    ),
}

FIXES: dict[str, tuple[str, ...]] = {
    "AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL": (
        "Cast the float32 tensors to the kernel's dtype right before the kernel (e.g. `q, k = q.to(v.dtype), "
        "k.to(v.dtype)`), or give the policy a rule that casts the norm's output: `out[*.q_norm]=bf16`.",
        "Audit for the device you deploy on: `castwise audit file.py:build --device cuda --policy bf16-mixed` "
        "finds it on a CPU-only machine.",
    ),
    "UNCAST_CUSTOM_OP_OR_EXTENSION": (
        "Decorate the autograd.Function's forward with `@torch.amp.custom_fwd(device_type=..., "
        "cast_inputs=torch.float32)` (or the kernel's dtype) and backward with `@torch.amp.custom_bwd`.",
        "Or cast the op's inputs to one dtype at the call: `ext_op(x.to(w.dtype), w)`.",
    ),
    "FASTPATH_BYPASSES_AUTOCAST": (
        "Turn the fast path off while running under autocast: `torch.backends.mha.set_fastpath_enabled(False)`, "
        "or a castwise policy with `fastpath=off` (e.g. `bf16-mixed,fastpath=off`).",
        "Audit both modes before training: `castwise audit file.py:build --policy bf16-mixed --mode both`.",
    ),
    "MODEL_INPUT_DTYPE_MISMATCH": (
        "Cast the inputs with the model (`x.to(model.dtype)`), or a `*-true` policy with `inputs=` casting.",
        "Or keep the weights float32 and run under autocast (`bf16-mixed` / `16-mixed`).",
    ),
    "KEEP_FP32_MODULE_LEAK": (
        "Cast the kept-float32 module's output back to the compute dtype (saturating to float16's range): "
        "`castwise.apply(model, Policy.parse('16-true'))` does this for _keep_in_fp32_modules.",
        "Or run in bfloat16, whose range needs no float32 islands.",
    ),
    "KEEP_FP32_MODULE_DOWNCAST": (
        "Do not cast the whole model with `.to(dtype)`; use the library's own precision option, or "
        "`castwise.apply(model, Policy.parse('bf16-true'))`, which keeps norm layers as float32 islands.",
        "By hand: cast the fp32 module's parameters back (`module.float()`).",
    ),
    "UNCONVERTED_TENSOR_OR_BUFFER": (
        "Create tensors in forward with the activations' dtype (`torch.arange(n, dtype=x.dtype)`), or register "
        "them as buffers so Module.to() reaches them.",
        "Cast the odd tensor where it first meets the activations: `t.to(x.dtype)`.",
    ),
    "STRICT_SAME_DTYPE_OP": (
        "Cast the source to the destination's dtype at the write: `dst[idx] = src.to(dst.dtype)`.",
    ),
    "MASK_DTYPE_MISMATCH": ("Build the mask with the query's dtype (`mask.to(q.dtype)`), or use a boolean mask.",),
    "ADAPTER_DTYPE_MISMATCH": (
        "Keep adapters and the base layer's input in one dtype: cast the input to the adapter weight's dtype "
        "in the adapter path and cast the result back (recent peft does this; upgrade).",
        "Run generate/evaluation under the same autocast as training, or cast the adapters: "
        "`model.to(torch.bfloat16)` after loading them.",
    ),
    "QUANT_COMPUTE_DTYPE_MISMATCH": (
        "Make the quantised layers' compute dtype equal the model's dtype: "
        "`BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.bfloat16)` with `torch_dtype=torch.bfloat16`.",
        "Cast the non-quantised neighbours (lm_head, norms, adapters) to that dtype too.",
    ),
    "GRADSCALER_LOW_PRECISION_PARAMS": (
        "Keep the trainable parameters float32 under fp16 autocast (mixed precision, not `.half()`), "
        "or use bf16 without a GradScaler (`bf16-mixed` / `bf16-true`).",
        "With Accelerate/Trainer: do not pass `fp16=True` for a model loaded in float16/bfloat16.",
    ),
    "OPTIMIZER_OR_GRAD_DTYPE": (
        "Keep gradients and optimizer states in the parameters' dtype: drop a float32 gradient precision "
        "on bf16 weights, or keep float32 master weights (mixed precision).",
        "Cast the update to the state's dtype in custom optimizers: `state.lerp_(update.to(state.dtype), w)`.",
    ),
    "NORM_PARAM_OR_STATS_DTYPE": (
        "Make the norm an fp32 island with casts at its boundaries (the `*-true` presets do), or cast its "
        "weights and running statistics with the input (`norm.to(x.dtype)`).",
    ),
    "TORCH_COMPILE_DTYPE": (
        "Check the same code in eager mode; if eager works, cast explicitly at the op that differs and "
        "report the graph break/dtype to PyTorch (`TORCH_LOGS=graph_breaks`).",
        "Avoid nested autocast regions inside compiled code.",
    ),
    "DISTRIBUTED_PRECISION_CONFIG": (
        "Make the framework's precision settings agree (one of fp16 or bf16 everywhere: DeepSpeed config, "
        "Accelerate/Lightning precision, the checkpoint's dtype), and let it cast the inputs too.",
        "`castwise lint-config` checks a training configuration for such contradictions.",
    ),
    "FP16_RANGE_OVERFLOW": (
        "Run the overflowing part in bfloat16 or float32 (an fp32 island), or use a checkpoint fixed for "
        "fp16 (e.g. the fp16-fix VAE).",
        "Write large constants with `torch.finfo(x.dtype).min` instead of -1e9.",
    ),
    "UNSAFE_OR_LOWPREC_LOSS": (
        "Use `binary_cross_entropy_with_logits` / `BCEWithLogitsLoss` on logits, or compute the loss in "
        "float32 outside autocast (`loss_fn(pred.float(), target.float())`).",
    ),
    "DTYPE_UNSUPPORTED_ON_DEVICE": (
        "Use a dtype the device supports (float16 on pre-Ampere GPUs, bfloat16 for CPU autocast), or run "
        "that op in float32 (an fp32 island).",
        "Upgrade torch if the kernel was added later.",
    ),
    "LOSS_SCALE_OR_UNDERFLOW": (
        "Keep trainable parameters in float32 (master weights) with fp16 autocast, or switch to bfloat16, "
        "which has float32's range and needs no loss scaling.",
        "If the scale collapses, find the first inf/NaN (`torch.autograd.detect_anomaly()`), lower the "
        "learning rate or raise Adam's eps; a fixed loss scale hides the problem, it does not fix it.",
    ),
    "LOWPREC_ROUNDING": (
        "Compute the sensitive part in float32: RoPE tables and phases, loss and metric accumulation, "
        "EMA/master weights and optimizer state (`.float()` or `torch.autocast(..., enabled=False)`).",
        "Keep bf16 for the matmuls only (autocast), not as the storage dtype of everything.",
    ),
}

# Wordings that name their cause outright, a cause outside the fitted model's categories (those
# are the report corpus's; a new one would need a refit): title, cause, fixes and the rule.
FAMILY_CAUSES: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "index-dtype": (
        "a dtype error: an integer tensor was made floating",
        "An op that takes integer (or bool) indices - indexing, embedding ids, index_select, gather/scatter, "
        "one_hot - got a floating tensor. The integer tensor became floating on the way: a cast of the index "
        "(`.to(bf16)`, `.half()`, `.float()`, `type_as`), a loader or engine casting every buffer or input to "
        "the model's dtype (Swin's relative_position_index, token ids under an fp16 engine), or a float made "
        "where an integer was meant (`/` for `//`, a factory without `dtype=torch.long`).",
        (
            "Keep the tensor integral: drop the cast of the index or ids, and cast only floating tensors "
            "(`if t.is_floating_point()`); `model.to(dtype)` already leaves integer buffers alone.",
            "Or make it integral at the use: `.long()` (`.bool()` for a mask). Casting it to the other "
            "operand's dtype does not help.",
            "`castwise audit` (CW116) names where it became floating, with the line.",
        ),
        "CW116",
    ),
}
