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
from castwise.diagnosis._context_clues import CONTEXT_CLUES
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
# norms' statistics, optimizers, compile and a loss computed in low precision can also quietly
# compute in the wrong dtype
SILENT_CAPABLE = frozenset({ev.OVF, ev.SCALE, ev.ROUND, ev.COMP, ev.DIST, ev.NORM, ev.OPT, ev.LOSS})
# devices whose half precision is known to fail without an error
SILENT_DEVICE_CLUES = frozenset({"clue:GTX 16xx"})
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
    feats += _bag_of_words(text)
    if compile_incidental(text, frames):
        feats = [f for f in feats if not _COMPILE_FEATURE.match(f.name)]
    # 4. the report's shape: an error raised, or a silent problem described in words. The same
    # words mean different things in the two (a T4 named next to an error is a missing kernel,
    # next to NaN outputs an fp16 overflow): in silent reports the word clues get their own weights
    has_error = bool(_ERROR_LINE.search(text)) or any(s.dtype_error for s in signals)
    if not has_error and not signals and _SILENT_WORDS.search(text) and not _ERROR_WORDS.search(text):
        feats = _silent_features(feats)
    return Evidence(tuple(feats), tuple(signals), tuple(frames), has_error)


# An error that meets torch.compile is not always compile's. The compiled graph runs the same ops
# eager runs: where the raising frame is the graph's own line (``<eval_with_key>``) or code outside
# the compiler, eager raises the same. Dynamo also runs each op on fake tensors while it traces;
# an op refusing its dtypes there is wrapped ("Failed running call_function ... got
# RuntimeError(...)") and is the op's error too. Compile differs from eager where the compiler
# itself raises (inductor, AOTAutograd, a backend), where a 0-d tensor is an operand (a CPU
# scalar eager's TensorIterator lets through, fake propagation checks), or where the user says
# eager works
_REPLAY = re.compile(
    r"(?:Dynamo failed to run FX node with fake tensors|Failed running call_(?:function|method|module))"
    r"(?P<call>.*?)(?:\bgot \w+\(|\n\S)",
    re.S,
)
_EAGER_DIFFERS = re.compile(
    r"size=\(\)|\b(?:works|fine|runs|passes) (?:in|with|under) eager|without (?:torch\.)?compile[^.\n]{0,30}"
    r"\b(?:works|fine|runs|passes)|\bonly (?:with|under|when) (?:torch\.)?compil|eager (?:mode )?(?:works|is fine)|"
    r"BackendCompilerFailed|LoweringException|InductorError|CompilationError",
    re.I,
)
_COMPILER_FRAME = re.compile(r"torch/(?:_dynamo|_inductor|_functorch|_subclasses|fx|_higher_order_ops)/|triton/")
_COMPILE_FEATURE = re.compile(
    r"(?:frame|text):torch\.compile$|clue:compiled graph$|word:(?:\w*dynamo\w*|\w*inductor\w*|compiled?|fake\w*|"
    r"torchruntimeerror|call_(?:function|method|module)|convert_frame|eval_frame|external_utils|run_node|"
    r"make_error_message|eval_with_key|compile_wrapper)$"
)


def compile_incidental(text: str, frames: list[Frame]) -> bool:
    """Whether torch.compile only carried an error eager raises too (see above)."""
    if _EAGER_DIFFERS.search(text):
        return False
    if _REPLAY.search(text):
        return True
    real = [f for f in frames if f.file != "<listing>" and not f.native]
    if not real or not any(_COMPILER_FRAME.search(f.path or f.file) for f in real):
        return False
    return not _COMPILER_FRAME.search(real[-1].path or real[-1].file)


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
            kind = kernel_kind(last.op) if last.family == "no-kernel-for-dtype" else None
            if kind is not None:
                feats.append(
                    Feature(f"kernel:{kind}", 1.0, f"{last.op} is {_KERNEL_WHY[kind]}", _KERNEL_PRIOR.get(kind, {}))
                )
    for op in sorted(ctx.ops):
        feats.append(Feature(f"code:{op}", 1.0, f"the failing code line is a {op} op"))
    if ctx.backward:
        feats.append(Feature("shape:backward", 1.0, "raised during backward"))
    if ctx.autocast:
        feats.append(Feature("shape:autocast", 1.0, "autocast / AMP is on"))
    return feats


# ATen's kernel names follow a few conventions (addmm_impl_cpu_, LayerNormKernelImpl,
# triu_tril_cuda_template, nll_loss_forward_out_cpu); an extension names its own
# (ROIAlign_forward, ms_deform_attn_forward_cuda, upfirdn2d): a kernel with no half version in an
# extension is the extension's limit, not the device's
_EXTENSION_KERNEL = re.compile(
    r"roi_?align|roi_?pool|deform|\bdcn|nms|knn|ball_query|furthest|voxel|spconv|sparse_conv|upfirdn|"
    r"bias_act|fused_leaky|filtered_lrelu|scatter_(?:max|min|mean)|segment_|grid_sample_3d|chamfer|emd",
    re.I,
)
_ATEN_KERNEL = re.compile(r"(?:_cpu_?|_cuda_?|_out|_template|Impl|Kernel|_kernel|_impl)$|^(?:at::|aten::)")
_KERNEL_WHY = {"aten": "one of PyTorch's own kernels", "extension": "a kernel of an extension, not PyTorch's"}
_KERNEL_PRIOR: dict[str, Weights] = {"extension": {ev.EXT: 9.0, ev.DEV: -6.0}}


def kernel_kind(op: str) -> str | None:
    """Whose kernel a "... not implemented for 'Half'" message names: PyTorch's or an extension's."""
    if _EXTENSION_KERNEL.search(op) or (op[:1].isupper() and not _ATEN_KERNEL.search(op)):
        return "extension"
    if _ATEN_KERNEL.search(op) or "::" in op:
        return "aten"
    return None


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


# 5. the words themselves: what the typed clues above do not name (a library, a model family,
# a flag) still says something about the cause. Each word is a feature with no prior; the fit
# keeps the words seen in two or more train reports and holds their weights small
_WORD = re.compile(r"[a-z_][a-z0-9_]{2,29}")
WORD_VALUE = 0.5
# English glue and the words every traceback has: they say nothing about a cause
_STOP = frozenset(
    [
        "the",
        "and",
        "for",
        "with",
        "that",
        "this",
        "from",
        "are",
        "was",
        "were",
        "not",
        "but",
        "have",
        "has",
        "had",
        "been",
        "can",
        "could",
        "would",
        "should",
        "will",
        "just",
        "when",
        "what",
        "which",
        "while",
        "there",
        "their",
        "then",
        "than",
        "them",
        "they",
        "you",
        "your",
        "our",
        "any",
        "all",
        "some",
        "one",
        "two",
        "use",
        "used",
        "using",
        "get",
        "got",
        "also",
        "into",
        "out",
        "only",
        "more",
        "most",
        "very",
        "like",
        "after",
        "before",
        "about",
        "does",
        "did",
        "doing",
        "done",
        "how",
        "why",
        "its",
        "here",
        "where",
        "other",
        "same",
        "each",
        "such",
        "may",
        "might",
        "must",
        "file",
        "line",
        "lines",
        "recent",
        "call",
        "last",
        "traceback",
        "self",
        "return",
        "forward",
        "site",
        "packages",
        "lib",
        "python",
        "usr",
        "local",
        "home",
        "env",
        "envs",
        "anaconda3",
        "miniconda3",
        "conda",
        "dist",
        "src",
        "args",
        "kwargs",
        "error",
        "errors",
        "runtimeerror",
        "exception",
        "raise",
        "raised",
        "issue",
        "bug",
        "bugs",
        "thanks",
        "thank",
        "hello",
        "please",
    ]
)


def words(text: str) -> list[str]:
    """The distinct telling words of a report, lowercased, in order of first appearance."""
    return [w for w in dict.fromkeys(_WORD.findall(text.lower())) if w not in _STOP]


def _bag_of_words(text: str) -> list[Feature]:
    return [Feature(f"word:{w}", WORD_VALUE, f"the word {w!r}") for w in words(text)]


def _silent_features(feats: list[Feature]) -> list[Feature]:
    """A report that raised no error and names none: its word clues become their silent
    versions, whose prior keeps only the causes that can be silent (a T4 named next to an error
    is a missing kernel; next to NaN outputs, no missing kernel was hit)."""
    out = [Feature("shape:no error message", 1.0, "no error message: a silent problem", SILENT_SHAPE)]
    for f in feats:
        if f.name.startswith(("text:", "clue:")):
            out.append(
                Feature(f"silent&{f.name}", f.value, f"{f.why}, with no error raised", _silent_prior(f.name, f.prior))
            )
        else:
            out.append(f)
    return out


def _silent_prior(name: str, prior: Weights) -> Weights:
    """A clue's prior in a report with no error: only the causes that can be silent."""
    keep = SILENT_CAPABLE | ({ev.DEV} if name in SILENT_DEVICE_CLUES else set())
    return {c: w for c, w in prior.items() if c in keep}


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
    for name in [n for n in out if n.startswith(("text:", "clue:"))]:
        silent = _silent_prior(name, out[name])
        if silent:  # a clue that speaks only for causes that raise says nothing in a silent report
            out[f"silent&{name}"] = silent
    out["ctx:no adapter evidence"] = {ev.ADA: -1.5}
    out["shape:no error message"] = SILENT_SHAPE
    for kind, weights in _KERNEL_PRIOR.items():
        out[f"kernel:{kind}"] = weights
    return out
