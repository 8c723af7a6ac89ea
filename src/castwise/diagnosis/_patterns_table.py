"""The table of PyTorch's dtype-error wordings (torch-free): one :class:`Pattern` per wording.

Each pattern says which op family a wording belongs to and which dtype sits on which side;
:mod:`castwise.diagnosis._patterns` runs them over a text. Also the dtype spellings torch prints
(:func:`dtype_name`), which the builders here use to normalise what they match.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# -- dtype spellings ---------------------------------------------------------------------------

_DTYPE_WORDS: dict[str, str] = {
    "float": "float32",
    "float32": "float32",
    "floattensor": "float32",
    "floattype": "float32",
    "fp32": "float32",
    "f32": "float32",
    "half": "float16",
    "float16": "float16",
    "halftensor": "float16",
    "halftype": "float16",
    "fp16": "float16",
    "f16": "float16",
    "bfloat16": "bfloat16",
    "bfloat16tensor": "bfloat16",
    "bfloat16type": "bfloat16",
    "bf16": "bfloat16",
    "double": "float64",
    "float64": "float64",
    "doubletensor": "float64",
    "doubletype": "float64",
    "long": "int64",
    "int64": "int64",
    "longtensor": "int64",
    "int": "int32",
    "int32": "int32",
    "bool": "bool",
    "byte": "uint8",
    "uint8": "uint8",
    "char": "int8",
    "int8": "int8",
    "complexfloat": "complex64",
    "complexhalf": "complex32",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    # C++ names (caffe2::TypeMeta): "expected dtype long int for `end`", "attn_mask.dtype: long int"
    "long int": "int64",
    "unsigned char": "uint8",
    "signed char": "int8",
    "short int": "int16",
    "short": "int16",
    "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128",
    "c10::complex<c10::half>": "complex32",
}


def dtype_name(token: str | None) -> str | None:
    """Any spelling torch prints (``c10::BFloat16``, ``struct c10::Half``, ``torch.cuda.HalfTensor``,
    ``CUDABFloat16Type``, ``'Float'``, ``torch.float32``) to a canonical name, or None."""
    if not token:
        return None
    t = token.strip().strip("'\"`,.()[]").strip()
    t = re.sub(r"^(struct|class)\s+", "", t)
    t = re.sub(r"\s+", " ", t)
    if t.lower() in _DTYPE_WORDS:  # "long int", "c10::complex<float>"
        return _DTYPE_WORDS[t.lower()]
    t = t.removeprefix("c10::").removeprefix("at::").removeprefix("torch.")
    t = t.removeprefix("cuda.").removeprefix("xpu.").removeprefix("mps.")
    low = t.lower()
    for prefix in ("cuda", "cpu", "xpu", "mps"):
        if low.startswith(prefix) and low[len(prefix) :] in _DTYPE_WORDS:
            low = low[len(prefix) :]
            break
    return _DTYPE_WORDS.get(low)


# one dtype token as torch prints it, including the two-word C++ names ("long int")
_DT = r"(?:(?:struct|class)\s+)?(?:(?:long|unsigned|signed|short)\s+(?=int\b|char\b))?[\w.:<>]+"


# -- wordings -----------------------------------------------------------------------------------


Builder = Callable[["re.Match[str]"], dict[str, object]]


@dataclass(frozen=True)
class Pattern:
    family: str
    regex: re.Pattern[str]
    build: Builder
    dtype_error: bool = True


def _two(a: int | str, b: int | str, roles: tuple[str, str] = ("", ""), op: str | None = None) -> Builder:
    def build(m: re.Match[str]) -> dict[str, object]:
        return {"first": dtype_name(m.group(a)), "second": dtype_name(m.group(b)), "roles": roles, "op": op}

    return build


def _const(op: str | None = None, first: str | None = None, second: str | None = None) -> Builder:
    def build(m: re.Match[str]) -> dict[str, object]:
        return {"op": op, "first": first, "second": second}

    return build


def _p(family: str, regex: str, build: Builder, *, dtype_error: bool = True, flags: int = re.I) -> Pattern:
    return Pattern(family, re.compile(regex, flags), build, dtype_error)


def _arg_op(m: re.Match[str]) -> dict[str, object]:
    arg = (m.group("arg") or "").lower()
    op = m.group("call") or None
    return {
        "first": dtype_name(m.group("exp")),
        "second": dtype_name(m.group("got")),
        "roles": ("expected", "found"),
        "op": op or ("matmul" if arg.startswith("mat") else None),
    }


def _conv(m: re.Match[str]) -> dict[str, object]:
    return {
        "first": dtype_name(m.group(1)),
        "second": dtype_name(m.group(3)),
        "roles": ("input", m.group(2).lower()),
        "op": "convolution",
    }


def _norm_cpu(m: re.Match[str]) -> dict[str, object]:
    side = (m.group("side") or "").lower()
    want = dtype_name(m.group("dt"))
    if side == "parameter":  # the input is `want`, the parameters are not
        return {"first": want, "roles": ("input", "weight"), "op": "norm", "device": "cpu"}
    return {"second": want, "roles": ("input", "weight"), "op": "norm", "device": "cpu"}


def _qkv(m: re.Match[str]) -> dict[str, object]:
    q, k, v = (dtype_name(m.group(i)) for i in (1, 2, 3))
    odd = v if q == k else k
    return {"first": q, "second": odd, "roles": ("query", "key/value"), "op": "scaled_dot_product_attention"}


def _xformers_qkv(m: re.Match[str]) -> dict[str, object]:
    text = m.string
    found = {name: dtype_name(d) for name, d in re.findall(r"(query|key|value)\.dtype\s*:\s*(\S+)", text)}
    q, v = found.get("query"), found.get("value")
    return {"first": q, "second": v, "roles": ("query", "value"), "op": "memory_efficient_attention"}


def _not_impl(m: re.Match[str]) -> dict[str, object]:
    return {"op": m.group(1), "first": dtype_name(m.group(2)), "roles": ("", "")}


def _addmv(m: re.Match[str]) -> dict[str, object]:
    self_, mat, vec = (dtype_name(m.group(i)) for i in (1, 2, 3))
    if mat != vec:
        return {"first": mat, "second": vec, "roles": ("mat", "vec"), "op": "addmv"}
    return {"first": self_, "second": mat, "roles": ("self", "mat"), "op": "addmv"}


def _checked_args(m: re.Match[str]) -> dict[str, object]:
    first_arg, second_arg = (m.group(1) or "").lower(), (m.group(2) or "").lower()
    checked = (m.group(5) or "").lower()
    fields: dict[str, object] = {
        "first": dtype_name(m.group(3)),
        "second": dtype_name(m.group(4)),
        "roles": (first_arg, second_arg) if second_arg else ("", ""),
    }
    if "grad" in first_arg or "backward" in checked:
        fields["op"] = "backward"
        return fields
    if not second_arg:
        return fields  # no argument names to go by: keep the old reading
    # a forward operand against a parameter: the input side of the layer
    if "conv" in checked:
        fields.update(family="conv-dtype", op="convolution")
    elif "rnn" in checked or "lstm" in checked or "gru" in checked:
        fields.update(family="rnn-dtype", op="rnn")
    elif "norm" in checked:
        fields.update(family="norm-arg-type", op="norm")
    else:
        fields.update(family="scalar-type-arg", op=checked or None)
    return fields


def _expected_got(m: re.Match[str]) -> dict[str, object]:
    a, b = dtype_name(m.group(1)), dtype_name(m.group(2))
    if a is None or b is None:
        return {"skip": True}
    return {"first": a, "second": b, "roles": ("expected", "got")}


PATTERNS: tuple[Pattern, ...] = (
    # -- GradScaler ----------------------------------------------------------------------------
    _p(
        "unscale-low-precision-grads",
        r"Attem?pt(?:ing|ed)? to unscale (?:FP16|half|float16) gradients",  # reports retype it with typos
        _const("GradScaler.unscale_", "float16"),
    ),
    _p(
        "unscale-low-precision-grads",
        r"\"?_amp_foreach_non_finite_check_and_unscale_\w*\"? not implemented for '(\w+)'",
        lambda m: {"op": "GradScaler.unscale_", "first": dtype_name(m.group(1))},
    ),
    # -- loss ----------------------------------------------------------------------------------
    _p(
        "unsafe-to-autocast",
        r"(binary_cross_entropy|BCELoss)[^\n]{0,60}unsafe to autocast",
        _const("binary_cross_entropy"),
    ),
    _p("loss-target-dtype", r"Found dtype (\w+) but expected (\w+)", _two(1, 2, ("found", "expected"))),
    # -- overflow ------------------------------------------------------------------------------
    _p(
        "fp16-overflow",
        r"value cannot be converted to type (?:at::|c10::)?(\w+) without overflow",
        lambda m: {"first": dtype_name(m.group(1)), "op": "fill"},
    ),
    # overflow that shows as NaN/inf or as a loss scaler giving up: precision, but no dtype clash
    _p(
        "nan-or-overflow",
        r"returned nan values|"
        r"\bloss (?:is|became|=) nan\b|\bnan loss\b",
        _const("loss scaling"),
        dtype_error=False,
    ),
    # -- device / dtype support ----------------------------------------------------------------
    _p(
        "autocast-dtype-unsupported",
        r"(Current CUDA Device does not support bfloat16|AutocastCPU only supports? \w+|"
        r"(?:CPU|CUDA|XPU|MPS) Autocast only supports dtype|autocast, but the target dtype is not supported|"
        r"Unexpected floating ScalarType in at::autocast::prioritize|"
        r"bf16/ampere gpu|Bfloat16 is only supported on GPUs with compute capability|"
        r"does not support bfloat16|BFloat16 is not supported on MPS|"
        r"is not supported on MPS|MPS does not support|Unsupported dtype for MPS)",
        _const("autocast"),
    ),
    _p(
        "flash-dtype",
        r"(FlashAttention only supports? (?:fp16 and bf16|fp16, bf16)|"
        r"only support(?:s)? fp16 and bf16 data type|"
        r"flash[_ ]attn[^\n]{0,40}(?:only|requires)[^\n]{0,30}(?:fp16|float16|bf16))",
        _const("flash_attn"),
    ),
    _p("no-kernel-for-dtype", r"\"([\w:]+)\" not implemented for '(\w+)'", _not_impl),
    # FFT: pocketfft/MKL, cuFFT, and the composite torch.fft functions
    _p(
        "no-kernel-for-dtype",
        r"(MKL FFT|cuFFT) doesn't support tensors? of type:? (\w+)",
        lambda m: {"op": "fft", "first": dtype_name(m.group(2))},
    ),
    _p("no-kernel-for-dtype", r"\bUnsupported dtype (\w+)", lambda m: {"op": "fft", "first": dtype_name(m.group(1))}),
    _p(
        "no-kernel-for-dtype",
        r"cuFFT only supports dimensions whose sizes are powers of two when computing in half",
        _const("fft", "float16"),
    ),
    # linalg and quantile refuse the low precision dtypes before any kernel runs
    _p(
        "no-kernel-for-dtype",
        r"([\w.]+): Low precision dtypes not supported\. Got (\w+)",
        lambda m: {"op": m.group(1), "first": dtype_name(m.group(2))},
    ),
    _p(
        "no-kernel-for-dtype",
        r"This function doesn't handle types other than float and double|"
        r"(\w+)\(\) input tensor must be either float or double dtype|"
        r"([\w.]+)\(\w+\{[^}]*\}\): expected a tensor with \d+ or more dimensions of float",
        lambda m: {"op": m.group(1) or m.group(2) or "linalg"},
    ),
    _p(
        "no-kernel-for-dtype",
        r"softmax with half to float conversion is not supported on (\w+)",
        lambda m: {"op": "softmax", "first": "float16", "device": m.group(1).lower()},
    ),
    _p(
        "complex-dtype",
        r"Expected both inputs to be Half, Float or Double tensors but got (\w+) and (\w+)",
        lambda m: {"op": "complex", "first": dtype_name(m.group(1)), "second": dtype_name(m.group(2))},
    ),
    # oneDNN refusing the dtypes it was given (bf16/f16 on a CPU without them, or a mix): the
    # message names no dtype, so it is read as a device limit, not as a dtype clash
    _p(
        "onednn-primitive",
        r"could not create a primitive descriptor for (?:the |an? )?(\w+)",
        lambda m: {"op": f"oneDNN {m.group(1)}", "device": "cpu"},
        dtype_error=False,
    ),
    _p(
        "no-kernel-for-dtype",
        r"Got unsupported ScalarType (\w+)",
        lambda m: {"op": "numpy conversion", "first": dtype_name(m.group(1))},
    ),
    # bf16 GEMMs on GPUs without bf16 support fail inside cuBLAS
    _p("cublas-not-supported", r"CUBLAS_STATUS_NOT_SUPPORTED", _const("cublas gemm")),
    _p(
        "complex-dtype",
        r"view_as_complex is only supported for half, float and double tensors, but got a tensor "
        r"of scalar type: (\w+)",
        lambda m: {"op": "view_as_complex", "first": dtype_name(m.group(1))},
    ),
    _p(
        "no-operator-found",
        r"No operator found for `?(memory_efficient_attention\w*)`?",
        _const("memory_efficient_attention"),
    ),
    # -- attention ------------------------------------------------------------------------------
    _p(
        "attn-mask-dtype",
        r"Expected attn_mask dtype to be bool or (?:float or )?to match query dtype, but got attn_mask\.dtype:\s*("
        + _DT
        + r")\s+and\s+query\.dtype:\s*("
        + _DT
        + r")",
        _two(1, 2, ("mask", "query"), "scaled_dot_product_attention"),
    ),
    _p("attn-bias-dtype", r"invalid dtype for bias - should match query'?s dtype", _const("attention bias")),
    _p(
        "qkv-dtype",
        r"Expected query, key,? and value to have the same dtype, but got query\.dtype:\s*("
        + _DT
        + r")\s+key\.dtype:\s*("
        + _DT
        + r")\s+and value\.dtype:\s*("
        + _DT
        + r")",
        _qkv,
    ),
    _p("qkv-dtype", r"Query/Key/Value should (?:either )?all have the same dtype", _xformers_qkv),
    # -- matmul family --------------------------------------------------------------------------
    _p(
        "matmul-dtype",
        r"mat1 and mat2 must have the same dtype(?:, but got (\w+) and (\w+))?",
        _two(1, 2, ("mat1", "mat2"), "matmul"),
    ),
    _p(
        "matmul-dtype",
        r"expected (?:mat1 and mat2|m1 and m2) to have the same dtype(?:, but got:?\s*("
        + _DT
        + r")\s*!=\s*("
        + _DT
        + r"))?",
        _two(1, 2, ("mat1", "mat2"), "matmul"),
    ),
    # a message cut at its start (logs that wrap or truncate) still says "got: X != Y"
    _p("matmul-dtype", r"^\s*got:\s*(" + _DT + r")\s*!=\s*(" + _DT + r")\s*$", _two(1, 2, ("mat1", "mat2"), "matmul")),
    _p(
        "matmul-dtype",
        r"self and mat2 must have the same dtype(?:, but got (\w+) and (\w+))?",
        _two(1, 2, ("self", "mat2"), "addmm"),
    ),
    # mv / addmv (a Linear on a 1-D input): "got {self}, {mat}, and {vec}"
    _p("matmul-dtype", r"addmv input tensors must have the same dtype(?:, but got (\w+), (\w+),? and (\w+))?", _addmv),
    _p(
        "matmul-dtype",
        r"Input dtypes must be the same, got: input (" + _DT + r"), batch1: (" + _DT + r")",
        _two(1, 2, ("input", "batch1"), "baddbmm"),
    ),
    _p(
        "scalar-type-arg",
        r"Expected object of scalar type (?P<exp>\w+) but got scalar type (?P<got>\w+) "
        r"for (?:\w+ )?argument(?: #?\d*\s*'?(?P<arg>\w+)'?)?"
        r"(?: in call to (?P<call>\w+))?",
        _arg_op,
    ),
    # -- convolution ----------------------------------------------------------------------------
    _p("conv-dtype", r"Input type \(([^)]+)\) and (weight|bias) type \(([^)]+)\) should be the same", _conv),
    # -- norms ----------------------------------------------------------------------------------
    _p(
        "norm-mixed-dtype",
        r"mixed dtype \(CPU\): (?:expect (?P<side>parameter|input) to have scalar type of (?P<dt>\w+)|"
        r"all inputs must share same datatype)",
        _norm_cpu,
    ),
    _p(
        "norm-output-type",
        r"output with type (\S+) doesn't match the desired type (\S+)",
        _two(1, 2, ("output", "desired")),
    ),
    # TensorUtils.cpp checkSameType, used by cuDNN/MIOpen conv, RNN and norm wrappers: the argument
    # names tell a backward gradient ('grad_output') from a forward operand ('input' vs 'weight')
    _p(
        "grad-output-type",
        r"Expected tensor for argument #\d+ '(\w+)' to have the same type as tensor for argument"
        r"(?: #\d+ '(\w+)'; but type (\S+) does not equal (\S+)(?: \(while checking arguments for (\w+)\))?)?",
        lambda m: _checked_args(m),
    ),
    # the norm kernels' backward (group_norm): the saved input X against the incoming gradient dY
    _p("norm-arg-type", r"Expected scalar types of X and dY are same", lambda m: {"op": "norm", "roles": ("X", "dY")}),
    # -- an index or label that is not integral: an integer tensor made floating (CW116) --------
    _p("index-dtype", r"tensors used as indices must be long, (?:int, )?byte or bool tensors", _const("index")),
    _p(
        "index-dtype",
        r"Expected tensor for argument #\d+ 'indices' to have one of the following scalar types: Long, Int; "
        r"but got (\S+) instead(?: \(while checking arguments for (\w+)\))?",
        lambda m: {"first": dtype_name(m.group(1)), "roles": ("indices", ""), "op": m.group(2) or "embedding"},
    ),
    _p(  # index_select / gather / scatter / index_add_ / index_copy_ (TensorAdvancedIndexing.cpp)
        "index-dtype",
        r"(\w+)\(\): Expected (?:dtype int32(?: or |/)int64|a long tensor) for index(?:,? but got:? (\w+))?",
        lambda m: {"op": m.group(1).rstrip("_"), "first": dtype_name(m.group(2)), "roles": ("index", "")},
    ),
    _p("index-dtype", r"one_hot is only applicable to index tensor", _const("one_hot")),
    # -- strict same-dtype ops ------------------------------------------------------------------
    _p(
        "index-put-dtype",
        r"Index put requires the source and destination dtypes match, "
        r"got (\w+) for the destination and (\w+) for the source",
        _two(1, 2, ("destination", "source"), "index_put"),
    ),
    _p(
        "masked-scatter-dtype",
        r"masked_scatter_?: expected self and source to have same dtypes but got\s*(\w+) and (\w+)",
        _two(1, 2, ("self", "source"), "masked_scatter"),
    ),
    _p(
        "scatter-dtype",
        r"(scatter\w*|gather|index_add\w*|index_copy\w*)\(\): Expected self\.dtype to be equal to src\.dtype",
        lambda m: {"op": m.group(1)},
    ),
    _p("scatter-dtype", r"Expected self\.dtype to be equal to src\.dtype", _const("scatter")),
    # index_copy_ / put_ / take / index_add_ / index_reduce_ (TensorAdvancedIndexing.cpp)
    _p(
        "scatter-dtype",
        r"(\w+)\(\): self and (source|out) expected to have the same dtype, but got "
        r"(?:\(self\) |self\.dtype = )(\w+) and (?:\(\w+\) |\w+\.dtype = )(\w+)",
        lambda m: {
            "op": m.group(1).rstrip("_"),
            "first": dtype_name(m.group(3)),
            "second": dtype_name(m.group(4)),
            "roles": ("self", m.group(2)),
        },
    ),
    _p(
        "scatter-dtype",
        r"(\w+)\(\): self \((\w+)\) and source \((\w+)\) must have the same scalar type",
        lambda m: {
            "op": m.group(1).rstrip("_"),
            "first": dtype_name(m.group(2)),
            "second": dtype_name(m.group(3)),
            "roles": ("self", "source"),
        },
    ),
    _p(
        "dot-dtype",
        r"(?:\bv?dot\s*:\s*)?expected both vectors to have same dtype, but found (\w+) and (\w+)",
        _two(1, 2, ("self", "other"), "dot"),
    ),
    _p(
        "inplace-arg-dtype",
        r"expected dtype (" + _DT + r") for `(\w+)` but got dtype (" + _DT + r")",
        lambda m: {
            "first": dtype_name(m.group(1)),
            "second": dtype_name(m.group(3)),
            "roles": ("self", m.group(2)),
            "op": "lerp" if m.group(2) in ("end", "weight") else None,
        },
    ),
    _p(
        "result-type-cast",
        r"result type (\w+) can't be cast to the desired output type (\w+)",
        _two(1, 2, ("result", "output")),
    ),
    _p(
        "rnn-dtype",
        r"RNN input dtype \(([^)]+)\) does not match weight dtype \(([^)]+)\)",
        _two(1, 2, ("input", "weight"), "rnn"),
    ),
    # RNN.cpp / cudnn/RNN.cpp: "Input and parameter tensors are not the same dtype, found input
    # tensor with Float and parameter tensor with Half" (and the same for the hidden state)
    _p(
        "rnn-dtype",
        r"Input and (parameter|hidden) tensors are not the same dtype, found input tensor with (\w+) "
        r"and (?:parameter|hidden) tensor with (\w+)",
        lambda m: {
            "first": dtype_name(m.group(2)),
            "second": dtype_name(m.group(3)),
            "roles": ("input", m.group(1).lower()),
            "op": "rnn",
        },
    ),
    # -- gradients ------------------------------------------------------------------------------
    _p(
        "grad-assign-dtype",
        r"attempting to assign a gradient with dtype '([^']+)' to a tensor with (?:grad_)?dtype '([^']+)'",
        _two(1, 2, ("gradient", "tensor"), "grad assignment"),
    ),
    _p("hook-changed-type", r"hook '[^']*' has changed the type of value", _const("gradient hook")),
    _p(
        "function-grad-dtype",
        r"Function \w+ returned an invalid gradient at index \d+ - expected (?:dtype|type) (\S+) but got (\S+)",
        _two(1, 2, ("expected", "got"), "backward"),
    ),
    # -- the data_ptr<T> check of older/legacy kernels and extensions ---------------------------
    # users paraphrase it ("expect scalar type Float but Half"): accept the loose forms
    _p(
        "scalar-type",
        r"expect(?:ed)? scalar type (" + _DT + r") but (?:found |got )?(" + _DT + r")",
        _two(1, 2, ("expected", "found")),
    ),
    # older torch: "expected type torch.cuda.FloatTensor but got torch.cuda.HalfTensor",
    # "expected dtype Float but got dtype Half"
    _p(
        "scalar-type",
        r"expected (?:type|dtype) (" + _DT + r") but got (?:type |dtype )?(" + _DT + r")",
        _two(1, 2, ("expected", "found")),
    ),
    _p("expected-got", r"\bExpected (\w+), got (\w+)\b", _expected_got, flags=0),
    _p(
        "triton-dtype",
        r"Both operands must be same dtype\. Got (\w+) and (\w+)",
        _two(1, 2, ("lhs", "rhs"), "triton dot"),
    ),
    # torch.cat / stack: "for sequence element 2 in sequence argument at position #1 'tensors'"
    _p(
        "cat-dtype",
        r"Expected object of scalar type (\w+) but got scalar type (\w+) for sequence element",
        _two(1, 2, ("expected", "found"), "cat"),
    ),
    # the oldest wording: "expected FloatTensor but found DoubleTensor", "expected Float but found Half"
    _p(
        "scalar-type",
        r"expected (?:type )?(\w*(?:Tensor|Float|Half|Double|BFloat16)) but (?:found|got) "
        r"(?:type )?(\w*(?:Tensor|Float|Half|Double|BFloat16))\b",
        _two(1, 2, ("expected", "found")),
    ),
    # messages cut short by a log, a title or an issue form: one dtype is still evidence
    _p(
        "scalar-type",
        r"expected (?:object of )?scalar type (\w+)(?: but)?\s*(?:\.\.\.|…|$)",
        lambda m: {"first": dtype_name(m.group(1)), "roles": ("expected", "found")},
    ),
    _p(
        "triton-dtype",
        r"First input \((\w+)\) and second input \((\w+)\) must have the same dtype",
        _two(1, 2, ("lhs", "rhs"), "triton dot"),
    ),
    # SyncBatchNorm's statistics kernel: running stats and counts must share a dtype
    _p(
        "norm-stats-dtype",
        r"Expected (counts|running_mean|running_var|mean|invstd) to have type (\w+) but got (\w+)",
        lambda m: {
            "first": dtype_name(m.group(2)),
            "second": dtype_name(m.group(3)),
            "roles": ("expected", m.group(1)),
            "op": "batch_norm_stats",
        },
    ),
    # flash-attn's rotary kernel (and its Triton port): the input against the cos/sin tables
    _p(
        "rotary-dtype",
        r"Input and cos/sin must have the same dtype, got (" + _DT + r") and (" + _DT + r")",
        _two(1, 2, ("input", "cos/sin"), "apply_rotary_emb"),
    ),
    # quantisation kernels that compute in one dtype only (AWQ/GPTQ: fp16)
    _p(
        "quant-dtype-unsupported",
        r"(" + _DT + r") is not supported for quantization method (\w+)",
        lambda m: {"first": dtype_name(m.group(1)), "op": m.group(2)},
    ),
    # FSDP flattens a wrapped module's parameters into one tensor: one dtype only
    _p(
        "flat-param-dtype",
        r"FlatParameter`? requires uniform dtype but got (" + _DT + r") and (" + _DT + r")",
        _two(1, 2, ("", ""), "FSDP flatten"),
    ),
    # collectives (all_gather, reduce_scatter) between buffers of two dtypes
    _p("collective-dtype", r"output tensor must have the same type as input tensor", _const("collective")),
    # the dynamic loss scaler shrinking on every step: fp16 gradients overflow (or the scale collapses)
    _p(
        "loss-scale-collapse",
        r"loss scale already at minimum|Gradient overflow\.\s+Skipping step|"
        r"reducing loss scale to|OVERFLOW! Rank \d+ Skipping step",
        _const("loss scaling"),
        dtype_error=False,
    ),
    # bf16 on hardware or builds without it, in the wordings of ptxas, Triton, vLLM and MPS
    _p(
        "autocast-dtype-unsupported",
        r"'\.bf16' requires \.target sm_80|doesn'?t support bf16|"
        r"Bfloat16 is only supported on|Trying to convert BFloat16 to the MPS backend|"
        r"BFloat16 is only supported on MacOS|does not support bfloat16",
        _const("bfloat16"),
    ),
)
