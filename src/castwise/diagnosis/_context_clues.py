"""Typed context clues beyond the hand-written tables of ``_evidence`` (torch-free).

Each clue is a regex over the whole report (prose, code, traceback) and a prior: the causes it
speaks for, in the tables' units. ``_features`` turns a match into a ``clue:<name>`` feature; the
fitted model starts from these priors and the corpus moves them where reports disagree.
"""

from __future__ import annotations

from castwise.diagnosis import _evidence as ev

CONTEXT_CLUES: tuple[ev.Clue, ...] = (
    ev._c(
        "GPU without bf16",
        r"\b(?:tesla )?(?:t4|v100|p100|p40|k80|gtx ?1\d\d\d|rtx ?20[6-8]0|20[6-8]0 ?ti|"
        r"1080 ?ti|turing|volta|pascal|sm_?[67]\d)\b|compute capability (?:of )?[3-7]\.\d",
        {ev.DEV: 3.0},
    ),
    ev._c(
        "GPU too old for the dtype",
        r"only supported on a100|\(too old\)|capability [><]=? ?\(\d, ?\d\)|compute capability [\d.]+ or higher|"
        r"requires? (?:an? )?(?:ampere|ada|hopper)|bf16 mixed precision requires|not compiled with half|"
        r"(?:doesn'?t|does not|not) support "
        r"(?:bf16|bfloat16)|cudnn_status_arch_mismatch|no kernel image is available",
        # the library itself says the device is the limit
        {ev.DEV: 8.0, ev.ISL: -3.0},
    ),
    # GTX 16xx cards have fp16 but no tensor cores and give NaN in half precision: a device limit
    # even when nothing is raised
    ev._c(
        "GTX 16xx",
        r"gtx ?16[56]0|\b16[56]0 ?(?:ti|super)?\b|quadro t[1-6]\d00|\bt[46]00\b|\bt1000\b",
        {ev.DEV: 3.0},
    ),
    ev._c(
        "CPU run",
        r"\bon (?:the )?cpu\b|device\s*=\s*['\"]cpu|--use-cpu|--device cpu|cpu[- ]only|cpu版本|"
        r"在cpu|\bcpu\b[^\n]{0,20}(?:inference|推理)|_cpu_?\b",
        {ev.DEV: 2.0},
    ),
    ev._c(
        "macOS / Apple GPU",
        r"\bmps\b|macbook|mac ?os|\bmac\b|apple silicon|\bm[1-4] (?:pro|max|ultra)\b|"
        r"sonoma|sequoia|ventura",
        {ev.DEV: 2.0},
    ),
    ev._c(
        "resume / checkpoint reload",
        r"resum(?:e|ing)|load_state_dict|from_checkpoint|reload(?:ed|ing)? "
        r"(?:the )?checkpoint",
        {ev.OPT: 1.5},
    ),
    ev._c(
        "black or blank images",
        r"black (?:images?|output|result|screen|video)|(?:all|pure|completely|total) "
        r"black|黑屏|黑图|全黑|blank images?",
        {ev.OVF: 4.0},
    ),
    ev._c(
        "loss scaling",
        r"loss[ _]?scal(?:e|er|ing)|skipping step|min_loss_scale|dynamic loss|scale went (?:less|below)",
        {ev.SCALE: 3.0},
    ),
    # GradScaler skips optimizer.step() while it calibrates the scale or meets inf gradients: the
    # scheduler then warns that it stepped first
    ev._c(
        "scheduler stepped before the optimizer",
        r"lr_scheduler\.step\(\)`? before `?optimizer\.step\(\)",
        {ev.SCALE: 3.0},
    ),
    ev._c(
        "training stalls",
        r"(?:loss|training)[^\n.]{0,20}(?:not decreas|stuck|stall|plateau|doesn'?t "
        r"(?:decrease|converge))|never converges?|decreases? (?:much )?(?:more )?slowly|"
        r"hasn'?t responded",
        {ev.SCALE: 1.5, ev.ROUND: 1.5},
    ),
    ev._c(
        "precision-loss words",
        r"precision (?:loss|issues?|errors?|problems?)|los(?:e|es|t|ing) precision|"
        r"\brounded?\b|\brounding\b|mantissa|\bulp\b|stochastic rounding|epsilon|"
        r"numerically identical|(?:can ?not|can no longer|cannot) represent|"
        r"accumulat(?:e|ion|ing) in (?:bf16|fp16|half|bfloat16)",
        {ev.ROUND: 3.0},
    ),
    ev._c(
        "results drift",
        r"different (?:results|outputs|values)|differs? from (?:fp32|float32|eager)|"
        r"diverge(?:s|nce)?|allclose|not (?:bit-)?exact|mismatch between",
        {ev.ROUND: 1.5, ev.COMP: 0.5},
    ),
    ev._c("EMA", r"\bema\b|moving average", {ev.OPT: 1.5, ev.ROUND: 1.0}),
    ev._c(
        "rotary embeddings",
        r"\brope\b|rotary|cos_cached|sin_cached|inv_freq|\bcos\b.{0,10}\bsin\b",
        {ev.ROUND: 0.5, ev.ISL: 1.0},
    ),
    ev._c(
        "apex fused norm", r"fusedlayernorm|fusedrmsnorm|fused_layer_norm|fused_rms_norm", {ev.EXT: 2.0, ev.LEAK: 0.5}
    ),
    ev._c("T5 family", r"\bt5\b|flan-t5|\bmt5\b|t5xxl|t5encoder|codet5", {ev.LEAK: 1.5, ev.OVF: 1.0}),
    ev._c("SyncBatchNorm", r"syncbatchnorm|sync_batchnorm|convert_sync_batchnorm|syncbn", {ev.NORM: 3.0}),
    ev._c("ZeRO++ / quantised communication", r"zero_quantized|zero\+\+|zero_hpz", {ev.QUANT: 2.0, ev.DIST: 2.0}),
    ev._c("8-bit optimizer", r"adamw_?8bit|8bit adam|paged_adamw", {ev.OPT: 0.5}),
    ev._c(
        "tensor created in the code",
        r"torch\.(?:zeros|ones|randn|rand|arange|tensor|full|empty|eye|linspace)(?:_like)?\(|\.new_(?:zeros|ones|"
        r"tensor|full)\(|hard-?coded|always (?:float32|fp32)|is still (?:torch\.)?float32|not converted|default dtype",
        {ev.UNC: 2.0, ev.MASK: 0.5},
    ),
    ev._c(
        "compiled extension in the code",
        r"/ops/\w+\.py|csrc/|\w+_cuda\.\w+\(|_ext\.\w+\(|\bext\.\w+\(|cuda kernel|c\+\+ extension|"
        r"data_ptr<float>|autograd\.function",
        {ev.EXT: 2.0},
    ),
    ev._c(
        "inputs named as the odd side",
        r"\binputs?\b[^\n.]{0,30}\b(?:float32|fp32|half|fp16|float16|double|float64)\b|\bcast (?:the )?inputs?\b|"
        r"(?:images?|pixel_values|latents|batch)\b[^\n.]{0,20}(?:float32|fp32|\.float\(\)|\.half\(\))",
        {ev.INP: 1.5},
    ),
    ev._c(
        "launcher or trainer",
        r"accelerate launch|torchrun|torch\.distributed\.launch|--nproc_per_node|deepspeed --|\bTrainer\(|"
        r"TrainingArguments|SFTTrainer|pl\.Trainer|lightning",
        {ev.DIST: 1.0},
    ),
    ev._c(
        "Adam's eps in half precision",
        r"\beps(?:ilon)?\b[^\n]{0,40}\b1e-?0?[78]\b|\b1e-?0?8\b[^\n]{0,60}(?:fp16|half|float16)|"
        r"\badam\w*\b[^\n]{0,60}\beps(?:ilon)?\b|\beps(?:ilon)?\b[^\n]{0,60}\badam",
        # 1e-8 is below fp16's smallest subnormal (6e-8): it flushes to zero
        {ev.SCALE: 6.0},
    ),
    ev._c(
        "Adam in half precision",
        r"\badam\w*\b[^\n]{0,80}\b(?:half|fp16|float16)\b|\b(?:half|fp16|float16)\b[^\n]{0,80}\badam",
        {ev.SCALE: 1.5, ev.OPT: 0.5},
    ),
    ev._c("fp8 / float8", r"\bfp8\b|float8|\be4m3|\be5m2|\bmxfp\d|\bnvfp4\b", {ev.QUANT: 2.0, ev.OVF: 0.5}),
    ev._c(
        "compiled graph",
        r"<eval_with_key>|\baot_\w+|nvfuser|torch/_inductor|torch/_dynamo|torchinductor|torch\.jit|torchscript|"
        r"\bfx graph|\bcudagraphs?\b|fullgraph",
        {ev.COMP: 3.0},
    ),
    ev._c(
        "extension kernel source",
        r"data<float>|data_ptr<float>|static_cast<(?:const )?float|\bAT_DISPATCH_FLOATING_TYPES\b|THCudaMalloc|"
        r"\b_C\.\w+\(|mmcv\.ops|mmcv/ops|detectron2[./]layers|deform(?:able)?_?conv|\bdcn(?:v\d)?\b|roi_?align|"
        r"ms_?deform|\bnms\b|setup\.py (?:build|install)|\.cu\b|load_inline|cpp_extension",
        {ev.EXT: 2.0},
    ),
    ev._c(
        "same-dtype op named",
        r"index_add|index_put|index_copy|masked_scatter|scatter_add|scatter_reduce|\.scatter_?\(|\blerp_?\b|"
        r"_foreach_\w+|\.copy_\(|\bout=",
        {ev.STRICT: 1.5},
    ),
    ev._c(
        "precision setting not applied",
        r"(?:still|remains?|stays?|kept) (?:in |as |at )?(?:torch\.)?(?:float32|fp32)|"
        r"(?:even|despite)[^\n]{0,30}(?:bf16|fp16|mixed[_ ]precision|precision)[^\n]{0,20}(?:set|requested|enabled)|"
        r"precision[^\n]{0,20}(?:ignored|not (?:applied|respected|passed))",
        {ev.DIST: 1.0},
    ),
    ev._c(
        "buffers named",
        r"\bbuffers?\b|register_buffer|buffer_dtype|\bcached? (?:tensor|table)|\bcos_cached|sin_cached",
        {ev.UNC: 1.0},
    ),
    ev._c(
        "two half types",
        r"(?:fp16|float16|half)[^\n]{0,60}(?:bf16|bfloat16)|(?:bf16|bfloat16)[^\n]{0,60}(?:fp16|float16|half)",
        {},
    ),
    # the languages reports come in: a few precision words are enough to weigh a Chinese report
    ev._c("zh: quantisation", r"量化", {ev.QUANT: 3.0}),
    ev._c("zh: not supported", r"不支持", {ev.DEV: 2.0}),
    ev._c("zh: overflow", r"溢出", {ev.OVF: 3.0}),
    ev._c("zh: half precision", r"半精度|混合精度|精度", {}),
    ev._c("zh: fine-tuning", r"微调|训练", {}),
    ev._c("zh: inference", r"推理", {}),
    # flags that say how the run was set up: no prior, the data decides what they mean
    ev._c(
        "dtype mismatch words",
        r"dtype mismatch|type mismatch|mismatch(?:ed)? (?:of )?(?:d)?types?|"
        r"same (?:d)?type|types? (?:do not|don'?t) match|wrong (?:d)?type",
        {},
    ),
    # (no clue for the half-precision words themselves: nearly every report has them, so they
    # would only learn the corpus's class frequencies)
    ev._c(
        "model cast to half",
        r"\.half\(\)|torch_dtype\s*=\s*torch\.(?:float16|half|bfloat16)|"
        r"model\.to\([^)]*(?:float16|bfloat16|half)",
        {},
    ),
    ev._c(
        "precision flag",
        r"--(?:fp16|bf16)\b|\b(?:fp16|bf16)\s*=\s*true|mixed_precision|precision\s*[=:]\s*['\"]?"
        r"(?:16|bf16)",
        {},
    ),
    # the failure came with switching a framework's precision on (a config dict, a DeepSpeed json, a
    # trainer option): the config, not the model code, is the first suspect
    ev._c(
        "precision switched on in a config",
        r"fp16\s*=\s*dict|[\"']fp16[\"']\s*:\s*\{|[\"']bf16[\"']\s*:\s*\{|(?:fp16|bf16)\.enabled|"
        r"enabl\w* (?:the )?(?:fp16|bf16|mixed[- ]precision|amp)\b|"
        r"(?:fp16|bf16) (?:config|mode|option) (?:is )?(?:on|enabled)",
        {ev.DIST: 1.0},
    ),
    ev._c("inference / generate", r"\bgenerate\(|\binference\b|\binfer\b|\.eval\(\)", {}),
    ev._c("UI front-end", r"comfyui|custom_nodes|webui|stable-diffusion-webui|invokeai|sdnext", {}),
    ev._c("detection toolbox", r"mmdet|mmcv|mmaction|mmseg|detectron2|fp16\s*=\s*dict", {}),
)
