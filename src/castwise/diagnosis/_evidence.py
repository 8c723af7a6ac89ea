"""The prior weights of evidence: what each kind of clue says about the root causes (torch-free).

Three channels, strongest first:
- the message's wording (a :class:`~castwise.diagnosis._patterns.Signal`): which op refused
  which dtypes. Some wordings name the cause outright ("Attempting to unscale FP16
  gradients"); the common ones (matmul, "expected scalar type") spread over many causes;
- traceback frames: the library and function the error went through (peft's LoRA layer,
  TransformerEncoderLayer's fused kernel, apex's fused norm, the GradScaler, inductor);
- words in the text and the code lines (LoRA, FSDP, BatchNorm, timesteps, attn_mask...),
  weakest, since users mention things that are not the cause.
Each rule fires at most once per text, so a long traceback through one library does not
outweigh a precise message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from castwise._dtypes import LOW

# short names, only for writing the tables compactly
ISL = "AUTOCAST_FP32_ISLAND_INTO_STRICT_KERNEL"
EXT = "UNCAST_CUSTOM_OP_OR_EXTENSION"
FP = "FASTPATH_BYPASSES_AUTOCAST"
INP = "MODEL_INPUT_DTYPE_MISMATCH"
LEAK = "KEEP_FP32_MODULE_LEAK"
DOWN = "KEEP_FP32_MODULE_DOWNCAST"
UNC = "UNCONVERTED_TENSOR_OR_BUFFER"
STRICT = "STRICT_SAME_DTYPE_OP"
MASK = "MASK_DTYPE_MISMATCH"
ADA = "ADAPTER_DTYPE_MISMATCH"
QUANT = "QUANT_COMPUTE_DTYPE_MISMATCH"
SCALER = "GRADSCALER_LOW_PRECISION_PARAMS"
OPT = "OPTIMIZER_OR_GRAD_DTYPE"
NORM = "NORM_PARAM_OR_STATS_DTYPE"
COMP = "TORCH_COMPILE_DTYPE"
DIST = "DISTRIBUTED_PRECISION_CONFIG"
OVF = "FP16_RANGE_OVERFLOW"
LOSS = "UNSAFE_OR_LOWPREC_LOSS"
DEV = "DTYPE_UNSUPPORTED_ON_DEVICE"
SCALE = "LOSS_SCALE_OR_UNDERFLOW"
ROUND = "LOWPREC_ROUNDING"

Weights = dict[str, float]

# -- message wordings -------------------------------------------------------------------------
# A generic mismatch (matmul, "expected scalar type") is spread over the causes that produce
# it in real reports; a specific one is concentrated.
_GENERIC_MATMUL: Weights = {
    INP: 2.8,
    ADA: 2.6,
    UNC: 2.0,
    MASK: 1.8,
    LEAK: 1.6,
    FP: 1.5,
    EXT: 1.5,
    QUANT: 1.6,
    DIST: 1.2,
    OPT: 0.6,
    COMP: 0.6,
    DOWN: 0.5,
}
_GENERIC_SCALAR: Weights = {
    INP: 2.5,
    UNC: 2.0,
    EXT: 2.0,
    DIST: 1.8,
    LEAK: 1.6,
    DOWN: 1.5,
    NORM: 1.5,
    FP: 1.5,
    ADA: 1.5,
    QUANT: 1.4,
    OPT: 0.8,
    COMP: 0.8,
    MASK: 0.5,
}

FAMILY_WEIGHTS: dict[str, Weights] = {
    "unscale-low-precision-grads": {SCALER: 14.0},
    "unsafe-to-autocast": {LOSS: 14.0},
    # TensorIterator's output-dtype check: loss backward, and optimizer updates writing into state
    "loss-target-dtype": {LOSS: 4.0, OPT: 3.0, STRICT: 1.0},
    "fp16-overflow": {OVF: 12.0},
    "autocast-dtype-unsupported": {DEV: 12.0},
    "flash-dtype": {DEV: 8.0, ISL: 3.0},
    "no-kernel-for-dtype": {DEV: 10.0},
    "cublas-not-supported": {DEV: 6.0, QUANT: 1.0},
    "nan-or-overflow": {OVF: 8.0, SCALER: 1.0},
    "complex-dtype": {DEV: 10.0},
    "no-operator-found": {ISL: 5.0, DEV: 4.0},
    "attn-mask-dtype": {MASK: 10.0, COMP: 1.0},
    "attn-bias-dtype": {MASK: 6.0, COMP: 3.0},
    "qkv-dtype": {ISL: 9.0, MASK: 1.0, EXT: 1.0, UNC: 1.0},
    "matmul-dtype": _GENERIC_MATMUL,
    "scalar-type-arg": _GENERIC_MATMUL,
    "conv-dtype": {INP: 5.0, UNC: 2.5, DIST: 1.5, EXT: 0.8, NORM: 0.5},
    "norm-mixed-dtype": {NORM: 5.0, DOWN: 3.0, LEAK: 1.0},
    "norm-output-type": {NORM: 5.0, STRICT: 3.0},
    # a gradient against a weight in backward: the gradient side first; a norm only when the
    # frames or words name one (cudnn_batch_norm_backward)
    "grad-output-type": {OPT: 6.0, NORM: 3.0},
    # cuDNN batch norm's argument check in the forward: input against the norm's parameters
    "norm-arg-type": {NORM: 5.0, DOWN: 1.5, LEAK: 1.0, INP: 1.0},
    "index-put-dtype": {STRICT: 12.0},
    "masked-scatter-dtype": {STRICT: 12.0},
    "scatter-dtype": {STRICT: 12.0},
    "dot-dtype": {STRICT: 9.0},
    "inplace-arg-dtype": {STRICT: 5.0, OPT: 4.5},
    "result-type-cast": {STRICT: 4.0, UNC: 2.0},
    "rnn-dtype": {INP: 8.0},
    "grad-assign-dtype": {OPT: 7.0, COMP: 3.0, DIST: 2.0},
    "hook-changed-type": {OPT: 9.0},
    "function-grad-dtype": {OPT: 5.0, EXT: 3.0},
    "scalar-type": _GENERIC_SCALAR,
    "expected-got": {OPT: 4.5, EXT: 1.0, INP: 0.5},
    "triton-dtype": {EXT: 6.0, ISL: 2.0, COMP: 2.0},
    "onednn-primitive": {DEV: 4.0, INP: 1.5, UNC: 1.0},
    "norm-stats-dtype": {NORM: 10.0, DIST: 1.0},
    "cat-dtype": {STRICT: 3.0, UNC: 3.0, INP: 1.0},
    "rotary-dtype": {ISL: 8.0, DIST: 1.5, UNC: 1.0},
    "quant-dtype-unsupported": {QUANT: 10.0, DEV: 2.0},
    "flat-param-dtype": {DIST: 8.0, ADA: 2.0},
    "collective-dtype": {DIST: 8.0},
    "loss-scale-collapse": {SCALE: 10.0, OVF: 2.0},
}


@dataclass(frozen=True)
class Clue:
    """One rule of evidence: a regex over a channel and the weights it adds when it matches."""

    name: str
    regex: re.Pattern[str]
    weights: Weights


def _c(name: str, regex: str, weights: Weights, flags: int = re.I) -> Clue:
    return Clue(name, re.compile(regex, flags), weights)


# -- traceback frames: matched against "library-path function" of every frame ------------------
FRAME_CLUES: tuple[Clue, ...] = (
    _c("peft LoRA layer", r"peft/tuners/lora", {ADA: 7.0}),
    _c("peft tuner layer", r"peft/(tuners/(?!lora)|peft_model)", {ADA: 5.0}),
    _c("unsloth LoRA kernel", r"unsloth/kernels/fast_lora", {ADA: 6.0, QUANT: 1.5}),
    _c("unsloth dequantisation", r"unsloth/kernels/\w*(dequant|utils)|fast_dequantize", {QUANT: 5.0}),
    _c("unsloth", r"unsloth/", {ADA: 1.0, QUANT: 1.0}),
    # the user's own script named for adapters (finetune_lora.py, qlora.py, train_peft.py): the
    # issue's "context ignored" case; library files are excluded, peft's own frames are above
    _c(
        "adapter script name",
        r"^[^ ]*(?:lora|peft|adapter)[^ /]*\.py ",
        {ADA: 4.0},
    ),
    _c("bitsandbytes", r"bitsandbytes/", {QUANT: 7.0}),
    _c("quantisation backend", r"(optimum/quanto|quanto/|torchao/|auto_gptq|awq/|hqq/|gptqmodel)", {QUANT: 6.0}),
    _c("xFormers", r"xformers/", {ISL: 7.0}),
    _c("flash-attn", r"flash_attn/", {ISL: 3.0, DEV: 3.0}),
    _c("apex fused norm", r"apex/normalization|fused_layer_norm|fused_rms_norm", {LEAK: 3.0, ISL: 3.0, EXT: 1.0}),
    # apex amp patches functions to cast (like autocast): ops it does not know still get the mix
    _c("apex amp", r"apex/(amp|fp16_utils)", {DIST: 1.0, EXT: 1.0, NORM: 0.5, SCALER: 0.5}),
    _c("GradScaler", r"(amp/grad_scaler|sharded_grad_scaler)|\bunscale_\b|unscale_gradients", {SCALER: 8.0}),
    _c("DeepSpeed runtime", r"deepspeed/", {DIST: 5.0}),
    _c("FSDP", r"torch/distributed/(fsdp|_composable/fsdp)|fully_sharded", {DIST: 5.0}),
    _c("distributed framework", r"(megatron|colossalai|fairscale)/", {DIST: 3.0}),
    _c(
        "Lightning precision plugin", r"(lightning|lightning_fabric|pytorch_lightning)/.*plugins/precision", {DIST: 3.0}
    ),
    _c("mmengine strategy", r"mmengine/(_strategy|optim|runner)", {DIST: 2.0}),
    # torch/_dynamo/eval_frame.py alone is no evidence: torch._compile.disable wraps custom ops
    # and checkpointing in every eager run
    _c(
        "torch.compile",
        r"torch/(_inductor|_dynamo/(?!eval_frame)|_functorch/aot_autograd|_higher_order_ops|"
        r"fx/experimental)|torchinductor_|compile_fx",
        {COMP: 7.0},
    ),
    _c("TransformerEncoderLayer fast path", r"_transformer_encoder_layer_fwd", {FP: 9.0}),
    _c("nn.MultiheadAttention fast path", r"_native_multi_head_attention", {FP: 6.0}),
    _c("torch.nn transformer module", r"torch/nn/modules/transformer\.py", {FP: 4.0}),
    _c("OpenCLIP", r"open_clip/", {DOWN: 4.0}),
    _c("T5 model", r"models/t5/|modeling_t5|/t5\.py", {LEAK: 3.0, OVF: 1.0}),
    _c(
        "norm layer",
        r"torch/nn/modules/(batchnorm|normalization|instancenorm)\.py|\b(batch|group|instance)_norm\b",
        {NORM: 2.5},
    ),
    _c(
        "optimizer step",
        r"(torch/optim/|/optim(izers?)?/|optimizer\.py|/optimizers?\.py)|"
        r"\b(step|_single_tensor_\w+|_multi_tensor_\w+|update_preconditioner)\b.*optim|"
        r"\b_(fused|foreach)_adam",
        {OPT: 6.0},
    ),
    _c(
        "backward pass",
        r"torch/(autograd/__init__\.py|_tensor\.py) backward|_engine_run_backward|\bbackward\b",
        {OPT: 1.5, EXT: 0.5, QUANT: 0.5, ADA: 0.5},
    ),
    _c("autograd.Function", r"torch/autograd/function\.py", {EXT: 1.5}),
    _c("Triton kernel", r"triton/", {EXT: 4.0, COMP: 1.0}),
    _c("binary_cross_entropy", r"functional\.py binary_cross_entropy\b", {LOSS: 8.0}),
    _c("attention kernel call", r"scaled_dot_product_attention|sdpa_attention", {MASK: 2.0, ISL: 1.0}),
    _c("timestep embedding", r"get_timestep_embedding|timestep_embedding|\bTimesteps\b", {UNC: 5.0}, flags=0),
    _c("RNN module", r"torch/nn/modules/rnn\.py", {INP: 2.0}),
    _c("generate()", r"generation/utils\.py|\bgenerate\b", {ADA: 1.0, LEAK: 1.0, INP: 0.5}),
)

# frame clues that only the user's own frames (no library) can fire
USER_FRAME_CLUES = frozenset({"adapter script name"})

# -- words in the whole text (message, code lines, the user's prose) --------------------------
TEXT_CLUES: tuple[Clue, ...] = (
    _c("LoRA", r"lora|\bdora\b", {ADA: 5.0}),
    _c("PEFT/adapters", r"\bpeft\b|\badapters?\b|\bia3\b|\bloha\b|\boft\b|ip[-_]?adapter|t2i[-_]?adapter", {ADA: 3.0}),
    _c(
        "quantised model",
        r"qlora|\b[48][-_ ]?bit|load_in_[48]bit|bnb_|bitsandbytes|quanto|quantiz|\bgptq\b|\bawq\b"
        r"|\bint8\b|\bnf4\b|dequant|qint8|\bfp8\b",
        {QUANT: 4.0},
    ),
    _c(
        "distributed/trainer precision",
        r"\bfsdp\b|fully_?sharded|mixedprecision\(|param_dtype|deepspeed|\bzero[-_ ]?[123]\b"
        r"|accelerate config|\bddp\b|distributeddataparallel|megatron",
        {DIST: 3.0},
    ),
    _c("DataParallel", r"\bdataparallel\b", {DIST: 1.0}),
    _c("torch.compile", r"torch\.compile|\binductor\b|\bdynamo\b|aot_?autograd|\bcompiled?\b", {COMP: 6.0}),
    _c("overflow/NaN", r"overflow|\binf\b|\bnans?\b|65504|black images?|isnan|infinit", {OVF: 4.0}),
    _c("VAE", r"\bvae\b", {OVF: 1.5}),
    _c(
        "tensor made outside the module tree",
        r"timestep|time_proj|sinusoid|torch\.arange|register_buffer|\bbuffers?\b|does not contain any weights|"
        r"always return f(loat)?32|plain tensor|freqs|pos(itional)?_emb",
        {UNC: 3.0},
    ),
    _c(
        "BatchNorm/GroupNorm",
        r"batch ?norm|\bbn\b|fix_bn|group ?norm|running_(mean|var)|sync_?bn|frozen ?batch",
        {NORM: 4.0},
    ),
    _c("norm layer", r"layer ?norm|layernorm|rms ?norm|\bln_\w*|_norm\b", {NORM: 1.0, DOWN: 1.0, LEAK: 1.0, ISL: 0.5}),
    _c("fp32 norm wrapper", r"layernormfp32|layer_norm_fp32|fp32 ?(layer)?norm", {DOWN: 3.0}),
    _c(
        "module kept in float32",
        r"_keep_in_fp32|keep_in_fp32|(convert\w*|cast\w*|kept|keeps?|upcast\w*) "
        r"[^.\n]{0,40}\b(to |in )?(float32|fp32)\b|upcast\w*[^.\n]{0,30}\b(norms?|layers?)\b|"
        r"\b(norms?|layers?)\b[^.\n]{0,30}upcast",
        {LEAK: 4.0},
    ),
    _c(
        "blanket cast of the model",
        r"model\.(to\(\s*(dtype\s*=\s*)?torch\.(bfloat16|float16|half)|half\(\)|bfloat16\(\))",
        {INP: 2.0, DOWN: 1.5},
    ),
    _c(
        "inputs cast at the call",
        r"\w\(\s*\w+\.to\(\s*(dtype\s*=\s*)?torch\.(bfloat16|float16)|\b(x|inputs?|latents?|"
        r"images?|pixel_values)\.(half|bfloat16)\(\)",
        {INP: 3.0},
    ),
    _c("eval/no_grad", r"\.eval\(\)|no_grad|inference_mode|validation|val_step|validation_step", {FP: 1.5}),
    _c(
        "nn.Transformer fast path",
        r"transformerencoder|transformer_encoder|nn\.transformer\b|multiheadattention|"
        r"fast ?path|bettertransformer",
        {FP: 4.0},
    ),
    _c("GradScaler", r"gradscaler|grad_scaler|\bunscale|scaler\.(scale|step)", {SCALER: 5.0}),
    _c(
        "optimizer",
        r"optimi[sz]er|exp_avg|\blerp_|preconditioner|\bstate\[|master weights|gradient_precision|"
        r"grad_dtype|\badamw?\b",
        {OPT: 3.0},
    ),
    _c("gradients", r"\bgrad(ient)?s?\b", {OPT: 1.0}),
    _c("backward", r"backward", {OPT: 1.0, EXT: 0.5}),
    _c(
        "custom op/extension",
        r"custom_fwd|custom_bwd|autograd\.function|\bextension\b|cpp_extension|\bcuda kernel|"
        r"\.cu\b|triton|\bfused_bias|custom (cuda|c\+\+|op|kernel)",
        {EXT: 3.0},
    ),
    # ops that ship as compiled extensions in detection/vision code bases
    _c(
        "extension op",
        r"deform(?:able)?[_ ]?(?:conv|pool|attn)|\bdcn(v\d)?\b|roi_?align|roi_?pool|\bnms\b|carafe|"
        r"ms_deform|spconv|\w_cuda\.\w+\(|\b_C\.\w+\(|\bext\.\w+\(",
        {EXT: 3.0},
    ),
    _c(
        "attention mask/bias",
        r"attn_mask|attention_mask|attn_bias|causal_mask|\bmask\b|additive bias|alibi|"
        r"position_bias",
        {MASK: 3.0},
    ),
    _c("scaled_dot_product_attention", r"scaled_dot_product_attention|\bsdpa\b", {MASK: 2.0, ISL: 1.0}),
    _c(
        "strict attention kernel",
        r"flex_attention|flash|xformers|memory_efficient_attention|\bq_norm|\bk_norm|qk_?norm",
        {ISL: 4.0},
    ),
    _c(
        "autocast",
        r"autocast|\bamp\b|torch\.cuda\.amp|precision=16|16-mixed|mixed precision",
        {ISL: 1.0, EXT: 1.0, FP: 0.5, LOSS: 0.5},
    ),
    _c("BCE loss", r"binary_cross_entropy|\bbce(loss)?\b|sigmoid", {LOSS: 4.0}),
    _c("loss", r"\bloss", {LOSS: 1.0}),
    _c("slowdown", r"\bslow(er|down)?\b|silent|performance|throughput", {ISL: 2.0, OVF: 0.5}),
    _c("embedding merge", r"inputs_embeds|image_features|\bembeds\b|index put|\bmerge", {STRICT: 1.5}),
    _c(
        "strict same-dtype op", r"\bscatter|index_put|masked_scatter|index_copy|index_add|\btorch\.cat\b", {STRICT: 3.0}
    ),
    _c(
        "old GPU",
        r"\bv100\b|\bt4\b|pre-?ampere|compute capability|\bvolta\b|\bturing\b|\bp100\b|\b(10|20)[6-8]0\b",
        {DEV: 4.0},
    ),
    _c("Apple/Intel device", r"\bmps\b|apple silicon|\bxpu\b", {DEV: 1.5, FP: 0.5}),
    _c("triu/tril", r"\btri[lu]\b", {DEV: 2.0}),
    _c("kept-fp32 tower", r"vision_tower|vision tower|mm_projector|projector", {LEAK: 1.5}),
    _c("manual half conversion", r"network_to_half|convert_to_half|\.half\(\)", {NORM: 0.5, INP: 0.5}),
)


@dataclass(frozen=True)
class Context:
    """What the traceback says around the failing op."""

    ops: frozenset[str]  # "linear", "matmul", "attention", "norm", "conv" from the innermost code
    backward: bool  # the error was raised during backward
    library_model: bool  # raised inside a model library's own modeling code
    autocast: bool  # the text says autocast / AMP was on
    device: str | None
    norm_upstream: bool = False  # a norm layer (q/k norm, norm1...) is named near the failing kernel
    has_frames: bool = False  # the text holds a traceback (else: a bare message)


_OP_CONTEXT: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "linear",
        re.compile(
            r"\bF\.linear\(|\.linear\(|nn\.Linear|\bself\.(weight|\w*proj\w*)\b|lm_head|"
            r"functional\.py linear\b|modules/linear\.py",
            re.I,
        ),
    ),
    ("matmul", re.compile(r"torch\.(matmul|bmm|mm|baddbmm|einsum)\(|\s@\s|\bmatmul\(|\bbmm\(", re.I)),
    ("attention", re.compile(r"attn|attention|softmax|scores|\bvalue|\bquery|\bkey\b|sdpa", re.I)),
    ("norm", re.compile(r"norm\b|_norm\(|norm\d*\(|\bln_?\w*\(|layer_norm|rms_norm|group_norm|batch_norm", re.I)),
    ("conv", re.compile(r"conv\w*\(|modules/conv\.py", re.I)),
)

_GENERIC = ("matmul-dtype", "scalar-type-arg", "scalar-type", "conv-dtype", "norm-mixed-dtype")


def op_context(codes: list[str]) -> frozenset[str]:
    """Op kinds named by the innermost code lines (what the failing line was doing)."""
    found = {name for name, rx in _OP_CONTEXT for code in codes if rx.search(code)}
    return frozenset(found)


def context_weights(
    family: str, roles: tuple[str, str], first: str | None, second: str | None, op: str | None, ctx: Context
) -> list[tuple[Weights, str]]:
    """What the dtypes, their sides and the surrounding code say, beyond the wording itself."""
    generic = family in _GENERIC
    # addmm's "self" is the bias or accumulator, not the activation: no activation side to read
    matmul_like = (family in ("matmul-dtype", "scalar-type-arg") and roles[0] != "self") or (
        family == "scalar-type" and bool(ctx.ops & {"linear", "matmul"})
    )
    out: list[tuple[Weights, str]] = []
    if first and second and first != second:
        out += _pair_weights(family, first, second, ctx, generic=generic, matmul_like=matmul_like)
    out += _family_weights(family, roles, first, second, op, ctx, matmul_like=matmul_like)
    if generic:
        out += _generic_op_weights(family, ctx)
    return out


def _pair_weights(
    family: str, first: str, second: str, ctx: Context, *, generic: bool, matmul_like: bool
) -> list[tuple[Weights, str]]:
    """What the two differing dtypes themselves say (8-bit, integer, two half types, float64...)."""
    out: list[tuple[Weights, str]] = []
    pair = {first, second}
    if pair & {"int8", "uint8", "float8_e4m3fn", "float8_e5m2"} and generic:
        # 8-bit operands in a float op: quantised weights reached a float kernel undequantised
        out.append(({QUANT: 6.0}, "an 8-bit (quantised) tensor met a floating one"))
    elif pair & {"int64", "int32", "bool"} and generic:
        # an index or label tensor, not a precision clash: none of the precision causes fits well
        out.append(
            (
                {c: -0.6 * w for c, w in _GENERIC_SCALAR.items()},
                "an integer tensor met a float one (labels or indices, not precision)",
            )
        )
    elif pair == set(LOW):
        # two half types met: something cast to the other half type (a wrapper's input cast, a
        # quantised layer's compute dtype), never an fp32 island. A kernel's data_ptr check
        # ("expected scalar type") is where out= buffers of dequantising kernels fail; a
        # layer's input check is where a wrapper's input cast fails.
        if family == "scalar-type":
            w: Weights = {QUANT: 3.5, DIST: 2.5}
        else:
            w = {DIST: 3.5, QUANT: 2.0}
        w.update({OPT: 1.5, MASK: 1.0, ADA: 1.0, INP: -1.0, FP: -1.5, DOWN: -2.0, LEAK: -2.0})
        out.append((w, "two different 16-bit dtypes met"))
    elif "float64" in pair:
        out.append(({UNC: 2.0, INP: 2.0}, "a float64 tensor (NumPy, Python defaults) met a float dtype"))
    elif matmul_like and first == "float32" and second in LOW:
        out.append(
            ({MASK: 0.8, INP: 0.5, LEAK: 0.5}, "the activation side is float32, the other operand low precision")
        )
    elif matmul_like and first in LOW and second == "float32":
        out.append(
            ({UNC: 1.0, ADA: 0.5, QUANT: 0.5}, "the activation side is low precision, the other operand float32")
        )
    elif family == "scalar-type" and "norm" in ctx.ops and first == "float32" and second in LOW:
        out.append(({DOWN: 2.0, LEAK: 1.0}, "a norm's float32 input met low-precision weights"))
    elif family == "scalar-type" and first in LOW and second == "float32" and not ctx.ops:
        out.append(({UNC: 1.0, EXT: 1.0}, "a kernel's first operand is low precision, another float32"))
    return out


def _family_weights(
    family: str,
    roles: tuple[str, str],
    first: str | None,
    second: str | None,
    op: str | None,
    ctx: Context,
    *,
    matmul_like: bool,
) -> list[tuple[Weights, str]]:
    """What one wording family, with its sides and context, says (flash, lerp, rnn, norm, conv bias)."""
    out: list[tuple[Weights, str]] = []
    if family == "flash-dtype" and ctx.autocast:
        # flash-attn refusing float32 under autocast: autocast's float32 outputs (norms, softmax,
        # fp32 parameters) reached a kernel that autocast does not cast
        out.append(({ISL: 5.0}, "a half-only attention kernel got float32 with autocast on"))
    if family == "inplace-arg-dtype" and op == "lerp" and not ctx.has_frames:
        # lerp_ is how optimizers (Adam's moments, SOAP/Shampoo preconditioners) and EMA updates
        # move state toward a gradient or parameter of another dtype: the likely caller when
        # nothing else is known; with a traceback, its frames say whose lerp it was
        out.append(({OPT: 2.0}, "lerp, with no traceback: most often an optimizer or EMA update"))
    if family == "rnn-dtype" and roles[1] == "hidden":
        out.append(({UNC: 2.0}, "an initial hidden state made outside the module kept its dtype"))
    if family in ("flash-dtype", "qkv-dtype", "no-operator-found") and ctx.norm_upstream:
        out.append(({ISL: 3.0}, "a norm layer upstream of the strict attention kernel returns float32"))
    if op == "norm" and roles == ("input", "weight"):
        if first == "float32":
            # the CPU norm kernels' own wording: a norm cast down (LayerNormFp32 fed a bf16 copy) or
            # norm parameters cast away from the input; kept just below NORM so frames decide
            out.append(({DOWN: 1.5, LEAK: 1.0}, "float32 input met low-precision norm parameters"))
        elif second == "float32":
            out.append(({NORM: 2.0}, "low-precision input met float32 norm parameters"))
    if family == "conv-dtype" and roles[1] == "bias" and first in LOW and second == "float32":
        # CUDA checks the weight before the bias: a bias complaint means the weight matched
        scale = 0.6 if ctx.device == "cpu" else 1.0
        out.append(
            (
                {UNC: 2.5 * scale, INP: -0.5 * scale},
                "the conv bias stayed float32 while input (and weight) are low precision",
            )
        )
    if family == "scalar-type" and matmul_like:
        # older kernels word a matmul mismatch this way: weigh it as one
        diff = {
            c: _GENERIC_MATMUL.get(c, 0.0) - _GENERIC_SCALAR.get(c, 0.0)
            for c in set(_GENERIC_MATMUL) | set(_GENERIC_SCALAR)
        }
        out.append((diff, "the failing line is a matmul/linear"))
    return out


def _generic_op_weights(family: str, ctx: Context) -> list[tuple[Weights, str]]:
    """For the generic wordings: what the failing op, the phase and the code around it say."""
    out: list[tuple[Weights, str]] = []
    if "linear" in ctx.ops:
        out.append(({ADA: 1.0, QUANT: 0.5, MASK: -1.5}, "the failing op is a Linear"))
    elif "attention" in ctx.ops and ("matmul" in ctx.ops or family == "matmul-dtype"):
        # two activations meet (scores @ value): no weight, so no adapter or model-input side
        out.append(({MASK: 1.5, ISL: 0.5, ADA: -1.5, INP: -1.0}, "the failing op is an attention matmul"))
    if "norm" in ctx.ops and family != "norm-mixed-dtype":
        out.append(({NORM: 2.0, DOWN: 1.5, LEAK: 1.0, MASK: -1.0}, "the failing op is a norm layer"))
    if ctx.backward and family != "conv-dtype":
        # autograd's own backward of a forward that worked is consistent: a mismatch inside
        # backward comes from hand-written backward kernels (quantised, fused adapters, custom)
        out.append(
            (
                {QUANT: 2.0, EXT: 1.5, OPT: -1.0, INP: -1.5, FP: -1.5, MASK: -1.0},
                "raised during backward, in a matmul of a hand-written backward",
            )
        )
    if ctx.library_model and not ctx.backward:
        # a mature model library's code mismatches only when something outside it cast part
        # of the model (a wrapper, adapters, quantisation, fp32-kept modules)
        out.append(
            (
                {DIST: 1.5, ADA: 0.5, QUANT: 0.5, LEAK: 0.5, INP: -0.5},
                "raised inside a model library's own modelling code",
            )
        )
    if ctx.autocast and family == "scalar-type":
        # autocast casts the inputs of the ops it knows; a kernel's dtype check failing under it
        # is an op autocast does not know
        out.append(({EXT: 1.5, FP: 0.5, INP: -1.0}, "a kernel's dtype check failed under autocast"))
    return out


# clues that show adapters are in play; without one, the adapter cause is halved (see explain)
ADAPTER_CLUES = frozenset(
    {
        "peft LoRA layer",
        "peft tuner layer",
        "unsloth LoRA kernel",
        "unsloth",
        "LoRA",
        "PEFT/adapters",
        "adapter script name",
    }
)
