"""Traceback frames read from text (torch-free).

Users paste tracebacks in many shapes: CPython's (``File "x.py", line 3, in f``), pytest's
(``x.py:3: in f``), IPython's (``File ~/x.py:3, in f(a, b)`` followed by numbered source
lines), and C++ frames (``Exception raised from data_ptr<c10::BFloat16> at ...``). Each becomes
a :class:`Frame` with the library its file belongs to, so the weighing of evidence can say
"raised inside peft's LoRA layer" whatever the format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# libraries whose names in a path are evidence; a path segment equal to one of these names the
# library even for source checkouts (``~/src/unsloth/unsloth/kernels/...``)
KNOWN_LIBRARIES: tuple[str, ...] = (
    "accelerate",
    "apex",
    "bitsandbytes",
    "colossalai",
    "deepspeed",
    "diffusers",
    "fairscale",
    "fairseq",
    "flash_attn",
    "lightning",
    "lightning_fabric",
    "megatron",
    "mmcv",
    "mmdet",
    "mmengine",
    "open_clip",
    "optimum",
    "peft",
    "pytorch_lightning",
    "quanto",
    "sentence_transformers",
    "timm",
    "torch",
    "torchao",
    "torchvision",
    "transformer_engine",
    "transformers",
    "triton",
    "trl",
    "unsloth",
    "vllm",
    "xformers",
)
_KNOWN = set(KNOWN_LIBRARIES)

_PY = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>[^\s(]+))?')
# IPython: "File ~/x.py:3, in f(a)"; VS Code wraps the path in a link: "File [~/x.py:3](vscode://...), in f"
_IPY = re.compile(
    r"^\s*File \[?(?P<file>[~/\\.\w:][^,\n\]]*?\.py):(?P<line>\d+)(?:\]\([^)]*\))?"
    r"(?:, in (?P<func>[\w.<>]+))?"
)
# Colab: "[/usr/local/lib/python3.12/dist-packages/torch/_tensor.py](https://localhost:8080/#) in backward(self)"
_COLAB = re.compile(r"^\s*\[(?P<file>[^\]\s]+\.py)\]\([^)]*\) in (?P<func>[\w.<>]+)")
_PYTEST = re.compile(r"^\s*(?P<file>[\w./\\~-]+\.py):(?P<line>\d+): in (?P<func>[\w.<>]+)")
# rich's pretty tracebacks: "│ /env/site-packages/peft/peft_model.py:575 in forward   │"
_RICH = re.compile(r"^[\s│|]*(?P<file>(?:[A-Za-z]:)?[~/\\][^\s:│|]*\.py):(?P<line>\d+) in (?P<func>[\w.<>]+)")
_CPP = re.compile(r"Exception raised from (?P<func>\S+) at (?P<file>[\w./\\-]+):(?P<line>\d+)")
# per-process prefixes of distributed launchers: "[rank0]: ", "[default3]:"
_LOG_PREFIX = re.compile(r"^\[(?:rank|default)?\d+\]:\s?")
_NUMBERED = re.compile(r"^\s*(?:-+>\s*)?\d{1,5}\s+(?P<code>\S.*)$")


@dataclass(frozen=True)
class Frame:
    """One traceback frame: where (file, line, function), in which library, and its code."""

    file: str
    line: int | None
    function: str | None
    code: str | None = None
    library: str | None = None  # "peft", "torch", ...; None for the user's own code
    path: str = ""  # the path inside the library ("peft/tuners/lora/layer.py"), or the file
    native: bool = False  # a C++ frame (``Exception raised from ...``)

    def to_dict(self) -> dict[str, object]:
        return {
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "library": self.library,
            "code": self.code,
        }

    def __str__(self) -> str:
        # inside a library the path from the library's folder on says all (and fits a line)
        where = (self.path if self.library else self.file) + (f":{self.line}" if self.line is not None else "")
        func = f" in {self.function}" if self.function else ""
        lib = f" [{self.library}]" if self.library else ""
        return f"{where}{func}{lib}"


def library_of(file: str) -> tuple[str | None, str]:
    """The library a file belongs to and the path inside it, from the path alone."""
    norm = file.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in norm:
            rest = norm.rsplit(marker, 1)[1]
            head = rest.split("/", 1)[0]
            name = head.removesuffix(".py")
            return name, rest
    parts = [p for p in norm.split("/") if p]
    # the last known segment wins: a user's "torch" checkout under "projects/" still reads right
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in _KNOWN and i < len(parts) - 1:
            return parts[i], "/".join(parts[i:])
    if norm.startswith("aten/") or "/aten/" in norm or norm.startswith("c10/"):
        return "torch", norm
    return None, norm


def _frame(file: str, line: str | None, func: str | None, *, native: bool = False) -> Frame:
    lib, path = library_of(file)
    return Frame(file=file, line=int(line) if line else None, function=func, library=lib, path=path, native=native)


def parse_frames(text: str) -> list[Frame]:
    """Every frame in ``text``, outermost first (as Python prints them), with its code line."""
    frames: list[Frame] = []
    lines = [_LOG_PREFIX.sub("", line) for line in text.splitlines()]
    i = 0
    while i < len(lines):
        raw = lines[i]
        m = _PY.match(raw) or _PYTEST.match(raw) or _IPY.match(raw)
        if m is not None:
            frame = _frame(m.group("file").strip(), m.group("line"), m.group("func"))
            code = _code_after(lines, i + 1)
            frames.append(_with_code(frame, code))
            i += 1
            continue
        colab = _COLAB.match(raw)
        if colab is not None:
            frame = _frame(colab.group("file"), None, colab.group("func"))
            frames.append(_with_code(frame, _code_after(lines, i + 1)))
            i += 1
            continue
        # rich's frames, with their box edges or without (the reader strips box drawing)
        r = _RICH.match(raw)
        if r is not None:
            frames.append(_frame(r.group("file"), r.group("line"), r.group("func")))
            i += 1
            continue
        c = _CPP.search(raw)
        if c is not None:
            frames.append(_frame(c.group("file"), c.group("line"), c.group("func"), native=True))
        i += 1
    return frames


def evidence_text(text: str, frames: list[Frame], inner: int = 3) -> str:
    """The text without what frames already say: frame headers (their paths are weighed as
    frames) and the code lines of outer frames (a model's outer layers pass ``attention_mask``
    and friends through every call; only the innermost code is about the failing op)."""
    py = [f for f in frames if not f.native]
    inner_codes = {f.code for f in py[-inner:] if f.code}
    outer_codes = {f.code for f in py[:-inner] if f.code} - inner_codes
    out: list[str] = []
    for raw in text.splitlines():
        line = _LOG_PREFIX.sub("", raw)
        if _PY.match(line) or _PYTEST.match(line) or _IPY.match(line) or _COLAB.match(line):
            continue
        if _RICH.match(line):
            continue
        num = _NUMBERED.match(line)
        code = num.group("code").strip() if num else line.strip()
        if code and code in outer_codes:
            continue
        out.append(line)
    return "\n".join(out)


def _with_code(frame: Frame, code: str | None) -> Frame:
    if code is None:
        return frame
    return Frame(frame.file, frame.line, frame.function, code, frame.library, frame.path, frame.native)


def _code_after(lines: list[str], start: int) -> str | None:
    """The source line(s) printed under a frame header: CPython's one indented line, pytest's
    block, or IPython's numbered listing (the line marked ``---->`` when there is one)."""
    block: list[str] = []
    marked: str | None = None
    for raw in lines[start : start + 12]:
        if _PY.match(raw) or _PYTEST.match(raw) or _IPY.match(raw) or _COLAB.match(raw):
            break
        if not raw.strip():
            if block or marked:
                break
            continue
        if re.match(r"^\s*[\^~]+\s*$", raw):  # 3.11+ caret markers
            continue
        if re.match(r"^[A-Z]\w*(Error|Exception|Warning)\b", raw.strip()) and not raw.startswith(" "):
            break
        num = _NUMBERED.match(raw)
        if num is not None:
            if raw.lstrip().startswith("-"):
                marked = num.group("code").strip()
            block.append(num.group("code").strip())
            continue
        if not raw.startswith((" ", "\t")):
            break
        block.append(raw.strip())
        if len(block) >= 3:
            break
    if marked is not None:
        return marked
    return block[0] if block else None


def numbered_code(text: str) -> list[str]:
    """Source lines from IPython-style listings (``113   return F.linear(...)``) anywhere."""
    return [m.group("code").strip() for m in map(_NUMBERED.match, text.splitlines()) if m is not None]


# frames that are only plumbing: the module call machinery, decorators, autograd's entry
_PLUMBING = re.compile(
    r"torch/(nn/modules/module\.py|nn/functional\.py|functional\.py|utils/_contextlib\.py|_tensor\.py|autograd/__init__\.py|"
    r"autograd/graph\.py|autograd/function\.py|_compile\.py|_dynamo/eval_frame\.py|"
    r"nn/parallel/|distributed/algorithms/|amp/autocast_mode\.py)"
    r"|accelerate/utils/operations\.py|accelerate/hooks\.py|transformers/utils/generic\.py"
    r"|transformers/utils/deprecation\.py|transformers/modeling_layers\.py"
)


# torch's thin layers: their forward only calls the op; the caller above them is more telling
_THIN = re.compile(r"torch/nn/modules/(linear|conv|normalization|batchnorm|sparse|container|dropout|flatten)\.py")


def is_plumbing(frame: Frame) -> bool:
    return frame.native or bool(_PLUMBING.search(frame.path.replace("\\", "/")))


def locus_frame(frames: list[Frame]) -> Frame | None:
    """The frame at fault: the innermost frame that is not call plumbing (the code that called
    the refusing op); a thin torch layer (nn.Linear...) yields to the frame that called it."""
    py = [f for f in frames if not f.native]
    useful = [f for f in py if not is_plumbing(f)]
    if not useful:
        return py[-1] if py else None
    inner = useful[-1]
    if _THIN.search(inner.path.replace("\\", "/")) and len(useful) > 1:
        return useful[-2]
    return inner
