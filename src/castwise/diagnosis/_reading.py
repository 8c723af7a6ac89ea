"""Reading a pasted report the way a person would (torch-free).

Reports arrive in every shape: coloured terminal output, distributed logs with ``[rank0]:``
prefixes, rich or Jupyter tracebacks, logs where progress bars overwrite the same line, chained
exceptions where the wrapper's traceback comes last, and error messages wrapped over two lines.
:func:`normalise` turns such a text into plain lines; :func:`raising_block` picks the traceback
block of the exception that was actually raised first (the cause, not the wrapper).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# CSI sequences (colours, cursor moves) and OSC sequences (hyperlinks, titles)
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# per-process prefixes: "[rank0]: ", "[default3]:", "0: [rank0]: ", "rank1: "
_PREFIX = re.compile(r"^\s*(?:\d+:\s*)?(?:\[(?:rank|default)?\d+\]:\s?|rank\d+:\s)")
# a progress bar: "  3%|▍  | 17/387 [05:25<1:57:56, 19.13s/it]" or "Steps:   0%|    | 0/800 [00:00<?, ?it/s]"
_PROGRESS = re.compile(r"\d+%\|.*\|\s*\d+/\d*|\[\d+:\d+<[^\]]*(?:it/s|s/it)[^\]]*\]")
# rich's tracebacks draw boxes: "│ /env/x.py:575 in forward   │"
_BOX_EDGE = re.compile(r"^[\s│┃|]+|[\s│┃|]+$")
_BOX_ONLY = re.compile(r"^[\s╭╮╰╯─━│┃┌┐└┘├┤┬┴┼═╔╗╚╝]+$|^\s*[╭╰][─━].*[─━][╮╯]\s*$")
_ERROR_START = re.compile(r"^\s*(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Warning)\s*:")
_FRAME_START = re.compile(r"^\s*(?:File [\"~\[/\\.]|Traceback|During handling|The above exception|\S+\.py:\d+)")

CHAIN_MARKERS = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def normalise(text: str) -> str:
    """Plain lines: no colour codes, no per-rank prefixes, no box drawing, no progress-bar
    redraws, and error messages that a terminal wrapped joined back into one line."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    lines: list[str] = []
    for raw in text.split("\n"):
        # a carriage return redraws the line: what was drawn last is what the user saw, but an
        # error printed after a progress bar on the same line must survive
        parts = [p for p in raw.split("\r") if p.strip()]
        if not parts:
            lines.append("")
            continue
        kept = [p for p in parts if not _PROGRESS.search(p)] or parts[-1:]
        for part in kept:
            line = _PREFIX.sub("", part)
            if "│" in line or "┃" in line:
                if _BOX_ONLY.match(line):
                    continue
                line = _BOX_EDGE.sub("", line)
            elif _BOX_ONLY.match(line):
                continue
            if _PROGRESS.search(line) and not _ERROR_START.match(line):
                # a progress bar with text glued after it: keep the text ("...it/s]Traceback")
                tail = re.split(r"(?:it/s|s/it)\]", line)[-1]
                if not tail.strip():
                    continue
                line = tail
            lines.append(line.rstrip())
    return "\n".join(_unwrap(lines))


def _unwrap(lines: list[str]) -> list[str]:
    """Join an error message's continuation lines: terminals and issue forms wrap long messages
    ("... should be the same or input should be a MKLDNN tensor\\nand weight is a dense tensor")."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _ERROR_START.match(line):
            joined = line
            j = i + 1
            while j < len(lines) and j <= i + 3:
                nxt = lines[j]
                if (
                    not nxt.strip()
                    or _ERROR_START.match(nxt)
                    or _FRAME_START.match(nxt)
                    or nxt.startswith(("  ", "\t"))
                    or not re.match(r"^[a-z(\[`'\"]", nxt.strip())
                ):
                    break
                joined = f"{joined.rstrip()} {nxt.strip()}"
                j += 1
            out.append(joined)
            # keep the original lines too: frame and code parsers see the text as pasted
            out.extend(lines[i + 1 : j])
            i = j
            continue
        out.append(line)
        i += 1
    return out


@dataclass(frozen=True)
class Blocks:
    """A text split at chained-exception markers, in the order Python prints them: the first
    block is the exception raised first (the cause), the last the outermost wrapper."""

    blocks: tuple[str, ...]

    @property
    def chained(self) -> bool:
        return len(self.blocks) > 1


def split_chain(text: str) -> Blocks:
    parts = [text]
    for marker in CHAIN_MARKERS:
        parts = [piece for part in parts for piece in part.split(marker)]
    return Blocks(tuple(p for p in parts if p.strip()) or (text,))


def raising_block(text: str, has_dtype_signal: object = None) -> str:
    """The block whose traceback raised the error: in a chain, the first block that holds a dtype
    message (the cause); the wrapper's frames (``raise ... from e``) are not the locus."""
    chain = split_chain(text)
    if not chain.chained:
        return text
    if callable(has_dtype_signal):
        for block in chain.blocks:
            if has_dtype_signal(block):
                return block
    return chain.blocks[0]
