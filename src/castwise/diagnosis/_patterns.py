"""PyTorch's many wordings of a dtype error, normalised into one structured signal (torch-free).

One cause reads differently across ops, devices (CPU, CUDA, MPS, XPU) and torch versions:
"mat1 and mat2 must have the same dtype", "expected m1 and m2 to have the same dtype",
"Expected object of scalar type Float but got scalar type Half for argument #2 'mat2'" all
say "a matmul got two dtypes". Each :class:`Pattern` recognises one wording and says which
op family it is and which dtype sits on which side; :func:`read_signals` returns every
:class:`Signal` found in a text. The wordings themselves are the table in
:mod:`castwise.diagnosis._patterns_table`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from castwise._dtypes import short
from castwise.diagnosis._patterns_table import PATTERNS, Builder, Pattern, dtype_name

__all__ = ["DTYPE_MENTION", "PATTERNS", "Builder", "Pattern", "Signal", "dtype_name", "read_signals"]


# -- signals ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signal:
    """A recognised dtype-error message: which op family refused which dtypes.

    ``first``/``second`` are the dtypes in the order the message names them; ``roles`` says
    what each side is when the wording tells ("input"/"weight", "destination"/"source",
    "query"/"mask", "expected"/"found")."""

    family: str
    text: str  # the matching line, as written
    first: str | None = None
    second: str | None = None
    roles: tuple[str, str] = ("", "")
    op: str | None = None
    device: str | None = None
    dtype_error: bool = True  # False for messages that are about precision but not a dtype clash

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d in (self.first, self.second) if d)

    def describe(self) -> str:
        a, b = (short(d) if d else None for d in (self.first, self.second))
        if a and b and self.roles[0]:
            sides = f"{self.roles[0]} {a}, {self.roles[1]} {b}"
        elif self.dtypes:
            sides = ", ".join(short(d) for d in self.dtypes)
        else:
            sides = ""
        op = f" in {self.op}" if self.op else ""
        return f"{self.family}{op}" + (f" ({sides})" if sides else "")


# every wording in PATTERNS contains one of these words; lines without any are skipped
_MAYBE = re.compile(
    r"type|dtype|half|float|bf16|fp16|fp32|implemented|unscale|overflow|autocast|support|nan\b|"
    r"same|cublas|operator|got|found|mat2|scalar|mixed|primitive|precision|loss scale|requires|indices",
    re.I,
)
_PAIR_FAMILIES = (
    "conv-dtype",
    "matmul-dtype",
    "scalar-type",
    "scalar-type-arg",
    "rnn-dtype",
    "norm-arg-type",
    "grad-output-type",
)


def read_signals(text: str) -> list[Signal]:
    """Every dtype-error wording in ``text``, in order of appearance; one per line at most."""
    found: list[tuple[int, Signal]] = []
    for line_start, line in _lines_with_offsets(text):
        if not _MAYBE.search(line):  # cheap gate: most log lines name no dtype at all
            continue
        for pattern in PATTERNS:
            m = pattern.regex.search(line)
            if m is None and pattern.family in ("qkv-dtype",):
                continue
            if m is None:
                continue
            if pattern.family == "qkv-dtype" and "query.dtype" not in line:
                # xFormers prints the dtypes on the following lines
                m = pattern.regex.search(text, line_start)
                if m is None:
                    continue
            fields = pattern.build(m)
            if fields.pop("skip", False):
                continue
            family = _str(fields.pop("family", None)) or pattern.family
            device = _device(line)
            same = fields.get("first") is not None and fields.get("first") == fields.get("second")
            if same and family in _PAIR_FAMILIES:
                # "Input type (torch.cuda.HalfTensor) and weight type (torch.HalfTensor)": one dtype,
                # two devices. Not a dtype error; say so rather than guess a precision cause
                found.append(
                    (
                        line_start,
                        Signal(
                            family="device-mismatch",
                            text=line.strip()[:300],
                            first=_str(fields.get("first")),
                            dtype_error=False,
                        ),
                    )
                )
                break
            sig = Signal(
                family=family,
                text=line.strip()[:300],
                dtype_error=pattern.dtype_error,
                device=device or _str(fields.get("device")),
                first=_str(fields.get("first")),
                second=_str(fields.get("second")),
                op=_str(fields.get("op")),
                roles=_roles(fields.get("roles")),
            )
            found.append((line_start, sig))
            break
    return [s for _, s in found]


def _str(v: object) -> str | None:
    return v if isinstance(v, str) else None


def _roles(v: object) -> tuple[str, str]:
    if isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, str) for x in v):
        return (v[0], v[1])
    return ("", "")


def _device(line: str) -> str | None:
    low = line.lower()
    if "cuda" in low:
        return "cuda"
    if "(cpu)" in low or "cpu" in low.split():
        return "cpu"
    if "mps" in low:
        return "mps"
    if "xpu" in low:
        return "xpu"
    return None


def _lines_with_offsets(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pos = 0
    for line in text.splitlines(keepends=True):
        out.append((pos, line.rstrip("\r\n")))
        pos += len(line)
    return out


# words that name a floating dtype anywhere in free text (for texts with no recognised wording)
DTYPE_MENTION = re.compile(
    r"\b(?:torch\.)?(?:bfloat16|float16|float32|half|bf16|fp16|fp32|HalfTensor|FloatTensor|BFloat16)\b", re.I
)
