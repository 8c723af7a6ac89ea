"""Evidence read structurally from a report, as named features for the fitted model (torch-free).

A report is read into four kinds of evidence, each a named feature with a value:

- the message (``msg:<family>``): which op refused which dtypes, in the wording's family; the
  dtype pair (``pair:f32/bf16``), the roles of the two sides (``roles:input/weight``) and the op
  (``op:linear``) as structural features;
- the frames (``frame:<clue>``, ``lib:<library>``, ``locus:<library>``): the libraries, modules
  and functions the traceback went through, and where it was raised;
- the context (``ctx:<reading>``): what the failing code line and the traceback say around the
  message (a Linear failed, raised in backward, an attention matmul...);
- words (``text:<clue>``, ``clue:<clue>``): typed clues in the user's prose and code (adapters,
  quantisation, a distributed engine, compile, a device or OS without bf16, resume, loss, NaN and
  overflow words), in English and in the Chinese that many reports are written in.

Every feature carries a prior: the weights that the hand-written tables of ``_evidence`` give it
(zero for the structural ones). ``benchmarks/fit_explain.py`` fits the model's weights starting
from and regularised toward these priors, so that data moves the weights where reports show the
tables wrong, and leaves them where the data is silent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from castwise.diagnosis import _evidence as ev
from castwise.diagnosis._frames import Frame, evidence_text, is_plumbing, locus_frame, numbered_code, parse_frames
from castwise.diagnosis._patterns import Signal, read_signals

Weights = dict[str, float]

# the prior's scale: the hand-written weights were tuned for a softmax at temperature 2
PRIOR_SCALE = 0.5


@dataclass(frozen=True)
class Feature:
    name: str
    value: float
    why: str  # what in the text fired it, for the evidence listing
    prior: Weights = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Evidence:
    """Everything read from one report: the features, the signals and frames they came from."""

    features: tuple[Feature, ...]
    signals: tuple[Signal, ...]
    frames: tuple[Frame, ...]
    has_error_line: bool

    def vector(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for f in self.features:
            out[f.name] = max(out.get(f.name, 0.0), f.value)
        return out

    def why(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in self.features:
            out.setdefault(f.name, f.why)
        return out


# -- typed context clues beyond the hand-written tables ---------------------------------------
CONTEXT_CLUES: tuple[ev.Clue, ...] = (
    ev._c(
        "GPU without bf16",
        r"\b(?:tesla )?(?:t4|v100|p100|p40|k80|gtx ?1\d\d\d|rtx ?20[6-8]0|20[6-8]0 ?ti|"
        r"1080 ?ti|turing|volta|pascal|sm_?[67]\d)\b|compute capability (?:of )?[3-7]\.\d",
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
    ev._c("loss scaling", r"loss[ _]?scal(?:e|er|ing)|skipping step|min_loss_scale|dynamic loss", {ev.SCALE: 3.0}),
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

_COARSE = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int64": "int",
    "int32": "int",
    "int16": "int",
    "int8": "int8",
    "uint8": "int8",
    "bool": "bool",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "complex64": "complex",
    "complex32": "complex",
    "complex128": "complex",
}

_MODEL_LIBS = ("transformers", "diffusers", "timm", "open_clip", "torchvision", "sentence_transformers")
_CODE_LINE = re.compile(r"^\s*(return\b|[\w.\[\]]+(\s*,\s*[\w.]+)*\s*=\s*[\w.]+\(|[\w.]+\()")
_NORM_WORD = re.compile(r"layer ?norm|rms ?norm|\b[qk]_?norm|\bnorm\d?\b|\bln_?\w*\(", re.I)
_AUTOCAST = re.compile(r"autocast|\bamp\b|torch\.cuda\.amp|mixed[_ ]precision|-mixed\b|precision=16", re.I)
_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception)\s*:", re.M)
# an error told in words when none is pasted ("it fails with", "报错"): not a silent problem
_ERROR_WORDS = re.compile(
    r"\berror\b|\bexception\b|\braise[sd]?\b|\bcrash|\bfail(?:s|ed)? (?:with|at|in|on|when)\b|\bthrows?\b|"
    r"traceback|报错|错误|异常|\bassert|not supported|unsupported|(?:doesn'?t|does not|cannot) (?:support|accept|run)|"
    r"\brejects?\b|\brefuses?\b|expected [^\n]{0,40} but|should be the same",
    re.I,
)
# what a silent problem looks like when told: wrong numbers, not a refusal
_SILENT_WORDS = re.compile(
    r"\bnan\b|\bnans\b|\binf\b|overflow|underflow|black|blank|diverg|converg|plateau|stall|stuck|"
    r"loss (?:is|becomes|goes|explod|spike|increas|jump)|explod|drift|differ|accuracy|precision (?:loss|issue)|"
    r"rounding|degrad|quality|worse|garbage|artifact|skipping step|loss scal|vanish|不收敛|溢出|黑",
    re.I,
)
# from the causes' definitions (castwise.categories): which can show without any error raised.
# Overflow, underflow and rounding are silent by nature; the others raise, except that engines,
# norms' statistics, optimizers and compile can also quietly compute in the wrong dtype
SILENT_CAPABLE = frozenset({ev.OVF, ev.SCALE, ev.ROUND, ev.COMP, ev.DIST, ev.NORM, ev.OPT})
SILENT_SHAPE: Weights = {ev.OVF: 1.0, ev.SCALE: 1.0, ev.ROUND: 1.0} | {
    c: -1.0
    for c in (
        ev.ISL,
        ev.EXT,
        ev.FP,
        ev.INP,
        ev.LEAK,
        ev.DOWN,
        ev.UNC,
        ev.STRICT,
        ev.MASK,
        ev.ADA,
        ev.QUANT,
        ev.SCALER,
        ev.LOSS,
        ev.DEV,
    )
}


def _frame_key(f: Frame) -> str:
    return f"{f.path} {f.function or ''} {f.code or ''}"


def _context(text: str, signals: list[Signal], frames: list[Frame]) -> ev.Context:
    inner = [f for f in frames if not f.native][-2:]
    codes = [_frame_key(f) for f in inner]
    if not codes:
        codes = numbered_code(text)[-2:] or [ln for ln in text.splitlines() if _CODE_LINE.match(ln)][-2:]
    # the frame that called the refusing op (not the thin-layer-skipping locus)
    lf = next((f for f in reversed(frames) if not is_plumbing(f)), None)
    library_model = (
        lf is not None and lf.library in _MODEL_LIBS and ("/models/" in f"/{lf.path}" or "modeling_" in lf.path)
    )
    backward = any(f.function in ("backward", "_engine_run_backward", "run_backward") for f in frames) or (
        not frames and bool(re.search(r"\bin backward\b|\.backward\(", text))
    )
    device = next((s.device for s in reversed(signals) if s.device), None)
    return ev.Context(
        ops=ev.op_context(codes),
        backward=backward,
        library_model=library_model,
        autocast=bool(_AUTOCAST.search(text)),
        device=device,
        norm_upstream=bool(_NORM_WORD.search(text)),
        has_frames=bool(frames),
    )


def extract(text: str, signals: list[Signal] | None = None, frames: list[Frame] | None = None) -> Evidence:
    """The evidence in a normalised report text."""
    if signals is None:
        signals = read_signals(text)
    if frames is None:
        frames = _default_frames(text)
    ctx = _context(text, signals, frames)
    keys = [_frame_key(f) for f in frames]
    feats = _message_features(signals, ctx)
    feats += _frame_features(frames, keys)
    feats += _word_features(text, signals, frames, keys)
    # 4. the report's shape: an error raised, or a silent problem described in words. The same
    # words mean different things in the two (a T4 named next to an error is a missing kernel,
    # next to NaN outputs an fp16 overflow): in silent reports the word clues get their own weights
    has_error = bool(_ERROR_LINE.search(text)) or any(s.dtype_error for s in signals)
    if not has_error and not signals and _SILENT_WORDS.search(text) and not _ERROR_WORDS.search(text):
        feats = _silent_features(feats)
    return Evidence(tuple(feats), tuple(signals), tuple(frames), has_error)


def _default_frames(text: str) -> list[Frame]:
    """The traceback's frames, or the lines of a numbered code listing when there are none."""
    frames = parse_frames(text)
    listing = numbered_code(text)
    if listing and not frames:  # IPython listings without frame headers still show the code
        frames = [Frame(file="<listing>", line=None, function=None, code=c, path="") for c in listing[-3:]]
    return frames


def _message_features(signals: list[Signal], ctx: ev.Context) -> list[Feature]:
    """1. The message: the last signal is the error itself; earlier ones (chained or repeated
    messages) count half. Then the dtypes, sides and op it names, and the code's shape."""
    feats: list[Feature] = []
    seen: set[str] = set()
    for i, sig in enumerate(reversed(signals)):
        if sig.family in seen:
            continue
        seen.add(sig.family)
        scale = 1.0 if i == 0 else 0.5
        feats.append(
            Feature(f"msg:{sig.family}", scale, f"message: {sig.describe()}", ev.FAMILY_WEIGHTS.get(sig.family, {}))
        )
        for weights, why in ev.context_weights(sig.family, sig.roles, sig.first, sig.second, sig.op, ctx):
            feats.append(Feature(f"ctx:{why}", scale, why, weights))
    if signals:
        last = signals[-1]
        a, b = (_COARSE.get(d or "", d or "") for d in (last.first, last.second))
        if a and b:
            feats.append(Feature(f"pair:{'/'.join(sorted((a, b)))}", 1.0, f"the dtypes are {a} and {b}"))
        elif a:
            feats.append(Feature(f"dtype:{a}", 1.0, f"the message names {a}"))
        if last.roles[0]:
            feats.append(
                Feature(
                    f"roles:{last.roles[0]}/{last.roles[1]}", 1.0, f"the sides are {last.roles[0]} and {last.roles[1]}"
                )
            )
        if last.op:
            feats.append(Feature(f"op:{last.op}", 1.0, f"the refusing op is {last.op}"))
    for op in sorted(ctx.ops):
        feats.append(Feature(f"code:{op}", 1.0, f"the failing code line is a {op} op"))
    if ctx.backward:
        feats.append(Feature("shape:backward", 1.0, "raised during backward"))
    if ctx.autocast:
        feats.append(Feature("shape:autocast", 1.0, "autocast / AMP is on"))
    return feats


def _frame_features(frames: list[Frame], keys: list[str]) -> list[Feature]:
    """2. Frames: each clue once, named by the first frame it matched; libraries; where it was raised."""
    feats: list[Feature] = []
    for clue in ev.FRAME_CLUES:
        user_only = clue.name in ev.USER_FRAME_CLUES
        hit = next(
            (
                f
                for f, k in zip(frames, keys, strict=True)
                if clue.regex.search(k) and not (user_only and (f.library or f.native))
            ),
            None,
        )
        if hit is not None:
            feats.append(Feature(f"frame:{clue.name}", 1.0, f"frame: {clue.name} ({hit})", clue.weights))
    real = [f for f in frames if f.file != "<listing>"]
    for lib in sorted({f.library for f in real if f.library and f.library != "torch"}):
        feats.append(Feature(f"lib:{lib}", 1.0, f"the traceback goes through {lib}"))
    lf = locus_frame(real)
    if lf is not None:
        where = lf.library or "user code"
        feats.append(Feature(f"locus:{where}", 1.0, f"raised from {where}"))
    if real:
        feats.append(Feature("shape:traceback", 1.0, "a traceback is pasted"))
    return feats


def _word_features(text: str, signals: list[Signal], frames: list[Frame], keys: list[str]) -> list[Feature]:
    """3. Words: the user's prose, the message and the innermost code; then context clues."""
    feats: list[Feature] = []
    words = evidence_text(text, frames) if frames else text
    adapter_seen = False
    for clue in ev.TEXT_CLUES:
        m = clue.regex.search(words)
        if m is not None:
            feats.append(
                Feature(
                    f"text:{clue.name}",
                    0.75 if frames else 1.0,
                    f"text: {clue.name} ({m.group(0).strip()!r})",
                    clue.weights,
                )
            )
            adapter_seen = adapter_seen or clue.name in ev.ADAPTER_CLUES
    adapter_seen = adapter_seen or any(
        c.name in ev.ADAPTER_CLUES and any(c.regex.search(k) for k in keys) for c in ev.FRAME_CLUES
    )
    generic = any(s.family in ("matmul-dtype", "scalar-type-arg", "scalar-type") for s in signals)
    if generic and not adapter_seen:
        # a generic mismatch spreads weight on adapters, but adapters are something the text must
        # show (peft/LoRA frames or words): a plain Linear (a Llama q_proj) failing is not enough
        feats.append(Feature("ctx:no adapter evidence", 1.0, "nothing in the text shows adapters", {ev.ADA: -1.5}))
    for clue in CONTEXT_CLUES:
        m = clue.regex.search(text)
        if m is not None:
            feats.append(
                Feature(f"clue:{clue.name}", 1.0, f"context: {clue.name} ({m.group(0).strip()!r})", clue.weights)
            )
    return feats


def _silent_features(feats: list[Feature]) -> list[Feature]:
    """A report that raised no error and names none: its word clues become their silent
    versions, whose prior keeps only the causes that can be silent (a T4 named next to an error
    is a missing kernel; next to NaN outputs, no missing kernel was hit)."""
    out = [Feature("shape:no error message", 1.0, "no error message: a silent problem", SILENT_SHAPE)]
    for f in feats:
        if f.name.startswith(("text:", "clue:")):
            prior = {c: w for c, w in f.prior.items() if c in SILENT_CAPABLE}
            out.append(Feature(f"silent&{f.name}", f.value, f"{f.why}, with no error raised", prior))
        else:
            out.append(f)
    return out


def static_priors() -> dict[str, Weights]:
    """The features whose prior is known without reading any report: message families, frame,
    text and context clues. The fit keeps these in the model even when training never sees them,
    so the hand-written knowledge is not lost where data is silent."""
    out: dict[str, Weights] = {}
    for family, weights in ev.FAMILY_WEIGHTS.items():
        out[f"msg:{family}"] = weights
    for clue in ev.FRAME_CLUES:
        out[f"frame:{clue.name}"] = clue.weights
    for clue in ev.TEXT_CLUES:
        out[f"text:{clue.name}"] = clue.weights
    for clue in CONTEXT_CLUES:
        out[f"clue:{clue.name}"] = clue.weights
    out["ctx:no adapter evidence"] = {ev.ADA: -1.5}
    out["shape:no error message"] = SILENT_SHAPE
    return out
