"""Inline SVG bar charts for the HTML report: no script, no library, no network.

A chart is rows of horizontal bars on a linear, log2 or log10 axis, each with an optional
reference tick (a tolerance, a dtype's largest value) and an optional inner bar (the error a
module added, inside the error it returned). Non-finite values draw a full-width bar marked bad.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Literal

Scale = Literal["linear", "log2", "log10"]

_ROW = 18  # px per bar
_BAR_W = 460  # px of the value axis
_TEXT_W = 170  # px right of the axis for the value text
_AXIS_H = 22  # px above the bars for tick labels


@dataclass(frozen=True)
class Bar:
    label: str
    value: float  # may be inf or nan: drawn full width, marked bad
    text: str  # printed right of the axis
    kind: str = ""  # CSS class suffix: a dtype ("bf16") or "bad", "warn", "ok"
    marker: float | None = None  # a reference tick on the same axis
    inner: float | None = None  # a second bar inside the first (same axis)
    tip: str = ""  # tooltip (defaults to label and text)


def _to_axis(value: float, scale: Scale) -> float:
    if scale == "log2":
        return math.log2(value)
    if scale == "log10":
        return math.log10(value)
    return value


def _domain(bars: list[Bar], scale: Scale) -> tuple[float, float]:
    values = [v for b in bars for v in (b.value, b.marker, b.inner) if v is not None and math.isfinite(v)]
    if scale == "linear":
        return 0.0, max([v for v in values if v > 0], default=1.0)
    logs = [_to_axis(v, scale) for v in values if v > 0]
    if not logs:
        return 0.0, 1.0
    # one step below the smallest value: the smallest bar still has a length to compare
    lo, hi = math.floor(min(logs)) - 1, math.ceil(max(logs))
    return lo, hi


def _x(value: float, scale: Scale, lo: float, hi: float) -> float:
    """Pixels from the axis start; values at or below the axis start draw nothing."""
    if not math.isfinite(value):
        return float(_BAR_W)
    if scale != "linear" and value <= 0:
        return 0.0
    pos = (_to_axis(value, scale) - lo) / (hi - lo)
    return max(0.0, min(1.0, pos)) * _BAR_W


def _tick_label(v: float, scale: Scale, fmt: Callable[[float], str] | None) -> str:
    if fmt is not None and scale == "linear":
        return fmt(v)
    if scale == "log2":
        return f"2^{int(v)}"
    if scale == "log10":
        return f"1e{int(v)}"
    return fmt_number(v)


def _ticks(lo: float, hi: float, scale: Scale) -> list[float]:
    if scale == "linear":
        return [lo + (hi - lo) * i / 4 for i in range(5)]
    step = max(1, math.ceil((hi - lo) / 8))
    # counted down from the top, so the axis end (often a dtype's limit) is always labelled
    return sorted(float(k) for k in range(int(hi), int(lo) - 1, -step))


def fmt_number(v: float) -> str:
    """3 significant digits; inf and nan spelled out."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.3g}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def bar_chart(
    name: str, bars: list[Bar], scale: Scale, title: str, tick_fmt: Callable[[float], str] | None = None
) -> str:
    """An SVG chart (``data-chart=name``), one row per bar; ``tick_fmt`` labels a linear axis."""
    label_w = min(320, max([len(b.label) for b in bars] + [4]) * 7 + 12)
    width = label_w + _BAR_W + _TEXT_W
    height = _AXIS_H + _ROW * len(bars) + 4
    lo, hi = _domain(bars, scale)
    parts = [
        f'<svg class="cw-chart" data-chart="{escape(name)}" role="img" aria-label="{escape(title)}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
    ]
    for t in _ticks(lo, hi, scale):
        x = label_w + (t - lo) / (hi - lo) * _BAR_W
        parts.append(f'<line class="cw-grid" x1="{x:.1f}" y1="{_AXIS_H - 4}" x2="{x:.1f}" y2="{height}"/>')
        parts.append(
            f'<text class="cw-tick" x="{x:.1f}" y="{_AXIS_H - 8}" text-anchor="middle">'
            f"{escape(_tick_label(t, scale, tick_fmt))}</text>"
        )
    for i, b in enumerate(bars):
        parts.append(_bar_row(b, i, label_w, scale, lo, hi))
    parts.append("</svg>")
    return "".join(parts)


def _bar_row(b: Bar, i: int, label_w: int, scale: Scale, lo: float, hi: float) -> str:
    y = _AXIS_H + i * _ROW
    label = b.label if len(b.label) * 7 + 12 <= label_w else "…" + b.label[-((label_w - 12) // 7 - 1) :]
    kind = "bad" if not math.isfinite(b.value) else b.kind
    w = _x(b.value, scale, lo, hi)
    out = [
        f'<g class="cw-bar-row" data-label="{escape(b.label)}"><title>{escape(b.tip or b.label + ": " + b.text)}'
        f"</title>",
        f'<text class="cw-label" x="{label_w - 6}" y="{y + 13}" text-anchor="end">{escape(label)}</text>',
        f'<rect class="cw-bar cw-k-{escape(kind)}" x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{_ROW - 6}"/>',
    ]
    if b.inner is not None:
        wi = _x(b.inner, scale, lo, hi)
        out.append(f'<rect class="cw-bar-inner" x="{label_w}" y="{y + 6}" width="{wi:.1f}" height="{_ROW - 12}"/>')
    if b.marker is not None and math.isfinite(b.marker):
        xm = label_w + _x(b.marker, scale, lo, hi)
        out.append(f'<line class="cw-marker" x1="{xm:.1f}" y1="{y + 1}" x2="{xm:.1f}" y2="{y + _ROW - 1}"/>')
    out.append(f'<text class="cw-value" x="{label_w + _BAR_W + 6}" y="{y + 13}">{escape(b.text)}</text></g>')
    return "".join(out)
