"""Each torch minor release's autocast lists, as recorded from its own dispatch table.

``scripts/record_torch_release.py``, run in a venv of that release, writes ``torch_X_Y.json``
here: per device ("cuda", "cpu"), the ops autocast runs in lower precision, keeps in f32
(``fp32``, or with ``dtype=f32`` added: ``fp32_set_opt_dtype`` / ``fp32_append_dtype``), promotes
to the widest input, or refuses (``banned``); ops whose arguments the probe could not build are
``unprobed`` and never emulated. Torch-free: the CLI checks a ``--torch`` value before it loads a
model.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from castwise.errors import AuditError

_DIR = Path(__file__).parent
CATEGORIES = ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")
# what each category means for the op's inputs, as a finding words it
_WORDS = {
    "lower_precision_fp": "runs in the autocast dtype",
    "fp32": "runs in f32",
    "fp32_set_opt_dtype": "computes in f32",
    "fp32_append_dtype": "computes in f32",
    "promote": "runs in its widest input's dtype",
    "banned": "is refused",
}
_DEVICE_WORDS = {"cuda": "CUDA", "cpu": "CPU"}


class TorchReleaseError(AuditError):
    """A ``torch=`` release castwise has no recorded autocast lists for."""


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


@functools.cache
def recorded() -> tuple[str, ...]:
    """The releases recorded here ("2.11", "2.14"...), oldest first."""
    found = [p.stem.removeprefix("torch_").replace("_", ".") for p in _DIR.glob("torch_*.json")]
    return tuple(sorted(found, key=_key))


def release_of(version: str) -> str:
    """The minor release of a torch version string ("2.11.0+cu130" -> "2.11")."""
    return ".".join(version.split("+")[0].split(".")[:2])


def parse_release(value: object) -> str:
    """``value`` ("2.11", "2.11.0") as a recorded minor release, or a TorchReleaseError."""
    text = str(value).strip()
    parts = text.split(".")
    if not isinstance(value, str) or len(parts) < 2 or not all(p.isdigit() for p in parts[:3]):
        raise TorchReleaseError(
            f"torch={value!r} is not a torch release; valid: {', '.join(recorded())} (e.g. torch='2.11')"
        )
    release = release_of(text)
    if release not in recorded():
        raise TorchReleaseError(
            f"torch={value!r}: no autocast lists recorded for torch {release}; valid: {', '.join(recorded())}; "
            "record it with scripts/record_torch_release.py in a venv of that release"
        )
    return release


@dataclass(frozen=True)
class AutocastLists:
    """One release's autocast lists: device -> op ("aten::rms_norm") -> category."""

    release: str
    torch: str
    ops: dict[str, dict[str, str]]
    unprobed: dict[str, frozenset[str]]

    def category(self, device: str, op: str) -> str | None:
        return self.ops.get(device, {}).get(op)

    def changed(self, other: AutocastLists, device: str) -> dict[str, tuple[str | None, str | None]]:
        """op -> (category here, category in ``other``) where they differ and both were probed."""
        mine, theirs = self.ops.get(device, {}), other.ops.get(device, {})
        skip = self.unprobed.get(device, frozenset()) | other.unprobed.get(device, frozenset())
        return {
            op: (mine.get(op), theirs.get(op))
            for op in sorted(set(mine) | set(theirs))
            if op not in skip and mine.get(op) != theirs.get(op)
        }


@functools.cache
def load(release: str) -> AutocastLists:
    data = json.loads((_DIR / f"torch_{release.replace('.', '_')}.json").read_text())
    ops: dict[str, dict[str, str]] = {}
    unprobed: dict[str, frozenset[str]] = {}
    for device, lists in data["autocast"].items():
        ops[device] = {op: cat for cat in CATEGORIES for op in lists.get(cat, [])}
        unprobed[device] = frozenset(lists.get("unprobed", {}))
    return AutocastLists(data["release"], data["torch"], ops, unprobed)


def since(op: str, device: str, release: str) -> str | None:
    """ "since torch 2.12, rms_norm runs in f32 under CUDA autocast" when ``op``'s category on
    ``device`` in ``release`` came with a recorded release after the first one, else None."""
    names = [r for r in recorded() if _key(r) <= _key(release)]
    if len(names) < 2:
        return None
    now = load(names[-1]).category(device, op)
    first = names[-1]
    for older in reversed(names[:-1]):
        lists = load(older)
        if op in lists.unprobed.get(device, frozenset()):
            return None
        if lists.category(device, op) != now:
            break
        first = older
    else:
        return None  # as in every recorded release
    short = op.removeprefix("aten::").split(".")[0]
    what = _WORDS[now] if now is not None else "is left to its inputs' dtypes"
    return f"since torch {first}, {short} {what} under {_DEVICE_WORDS.get(device, device)} autocast"


def _short(op: str) -> str:
    """The op a traced name stands for: "aten._fused_rms_norm.default" -> "rms_norm" (autocast
    lists the public op; the trace sees the kernel it decomposes to)."""
    name = op.removeprefix("aten::").removeprefix("aten.").split(".")[0].lstrip("_")
    for prefix in ("fused_", "native_"):
        name = name.removeprefix(prefix)
    return name


def cause_note(ops: tuple[str | None, ...], device: str, release: str) -> str | None:
    """The release that brought an op's autocast category (``since``), for the first of ``ops``
    (traced names: a finding's op, its origin's op) autocast lists on ``device``."""
    if release not in recorded():
        return None
    listed = load(release).ops.get(device, {})
    for op in ops:
        if op is None:
            continue
        for name in listed:
            if _short(name) == _short(op) and (note := since(name, device, release)) is not None:
                return note
    return None
