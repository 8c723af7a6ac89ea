"""The HTML report without a browser: structure, paths, charts, escaping, offline, writing."""

from __future__ import annotations

import math
import os
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import castwise
from castwise.errors import CastwiseError
from castwise.report import Finding, Origin, Report, Run
from castwise.report._html_tree import finding_path
from castwise.report.html import HtmlWriteError, render_fragment, render_html, write_html


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def having(self, attr: str, value: str | None = None) -> list[dict[str, str]]:
        return [a for _t, a in self.elements if attr in a and (value is None or a[attr] == value)]


def _parse(text: str) -> _Elements:
    parser = _Elements()
    parser.feed(text)
    return parser


class _UpToF32(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8).to(torch.bfloat16)
        self.block = nn.Sequential(_UpToF32(), nn.ReLU())
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


@pytest.fixture(scope="module")
def audit_report() -> Report:
    return castwise.audit(_Net(), torch.randn(2, 8, dtype=torch.bfloat16), mode="eval")


def test_the_page_shows_every_module_every_finding_and_the_dtype_charts(audit_report: Report) -> None:
    page = _parse(audit_report.to_html())
    nodes = [a["data-node"] for a in page.having("data-node")]
    assert nodes == [n for n, _ in _Net().named_modules()]
    findings = page.having("data-code")
    assert [a["data-code"] for a in findings] == [f.code for f in audit_report.sorted_findings()]
    up = next(a for a in findings if a["data-code"] == "CW120")
    assert up["data-module"] == "block.0"
    charts = {a["data-chart"] for a in page.having("data-chart")}
    assert charts == {"params-by-dtype", "activation-bytes"}
    # the up-cast module is flagged in the tree
    assert "silent up-cast" in audit_report.to_html()


def test_the_page_asks_for_nothing_outside_itself(audit_report: Report) -> None:
    text = audit_report.to_html()
    page = _parse(text)
    for attrs in page.having("src") + page.having("href"):
        link = attrs.get("src") or attrs.get("href") or ""
        assert link.startswith(("#", "data:")), link
    assert "@import" not in text and "url(" not in text
    # the only absolute URL is the SVG namespace, which is a name, not a request
    assert set(re.findall(r"https?://[^\s\"'<>]+", text)) <= {"http://www.w3.org/2000/svg"}
    assert "default-src 'none'" in text  # and the page forbids any request anyway


def test_a_finding_path_runs_from_its_origin_through_the_common_ancestor_to_where_it_shows() -> None:
    names = {"", "a", "a.b", "a.b.c", "d", "d.e"}
    f = {"module": "d.e", "origin": {"module": "a.b.c", "op": "aten.addmm", "tensor": "bf16[2]"}}
    assert finding_path(f, names) == ["a.b.c", "a.b", "a", "", "d", "d.e"]
    inside = {"module": "a", "origin": {"module": "a.b.c"}}
    assert finding_path(inside, names) == ["a.b.c", "a.b", "a"]
    from_input = {"module": "a.b", "origin": {"module": None, "tensor": "model input `x`"}}
    assert finding_path(from_input, names) == ["", "a", "a.b"]
    assert finding_path({"module": None}, names) == []
    assert finding_path({"module": "not.there"}, names) == []


def test_findings_and_their_origins_are_pinned_to_their_modules() -> None:
    names = ("", "enc", "proj")
    modules: list[dict[str, Any]] = [{"name": n, "type": "M", "params": {}, "inputs": [], "outputs": []} for n in names]
    report = Report(
        findings=[
            Finding(
                "CW103",
                "bad <b>fast</b> path",
                module="enc",
                op="aten.x",
                origin=Origin("proj", "aten.addmm", "bf16[40, 32]"),
                modes=("eval",),
            )
        ],
        runs=[Run("eval", "cpu", "bf16-mixed", "error")],
        summary={"modules": modules},
    )
    text = report.to_html()
    page = _parse(text)
    finding = page.having("data-code", "CW103")[0]
    assert (finding["data-module"], finding["data-origin"]) == ("enc", "proj")
    assert finding["data-path"] == '["proj", "", "enc"]'
    pins = page.having("data-finding", "0")
    assert len(pins) == 2  # one at `enc`, one ("origin of") at `proj`
    assert "bad &lt;b&gt;fast&lt;/b&gt; path" in text and "<b>fast</b>" not in text


def _numerics() -> dict[str, Any]:
    return {
        "findings": [
            {
                "code": "CW301",
                "name": "first-nonfinite",
                "severity": "error",
                "module": "mlp.down",
                "op": "aten.mm",
                "origin": None,
                "modes": ["train"],
                "message": "overflow",
                "fix": "keep",
            }
        ],
        "runs": [],
        "summary": {},
        "numerics": [
            {
                "module": "embed",
                "dtype": "f16",
                "absmax": 12.0,
                "margin_pow2": 12.4,
                "out_err": 1e-4,
                "added_err": 1e-4,
                "tolerance": 1e-3,
            },
            {
                "module": "mlp.up",
                "dtype": "f16",
                "absmax": 30000.0,
                "margin_pow2": 1.1,
                "out_err": 5e-3,
                "added_err": 4e-3,
                "tolerance": 1e-3,
            },
            {
                "module": "mlp.down",
                "dtype": "f16",
                "absmax": "inf",
                "margin_pow2": None,
                "out_err": "nan",
                "added_err": "nan",
                "tolerance": 1e-3,
                "first_nonfinite": True,
            },
        ],
        "title": "castwise numerics",
    }


def test_numerics_render_as_charts_with_tolerance_and_dtype_range_ticks() -> None:
    text = render_html(_numerics())
    page = _parse(text)
    charts = {a["data-chart"] for a in page.having("data-chart")}
    assert {"numerics-error", "numerics-range"} <= charts
    error_chart = text.split('data-chart="numerics-error"')[1].split("</svg>")[0]
    rows = re.findall(r'<g class="cw-bar-row" data-label="([^"]+)">(.*?)</g>', error_chart)
    assert [label for label, _ in rows] == ["embed", "mlp.up", "mlp.down"]
    kinds = {label: re.search(r'class="cw-bar cw-k-(\w+)"', body).group(1) for label, body in rows}  # type: ignore[union-attr]
    assert kinds == {"embed": "ok", "mlp.up": "bad", "mlp.down": "bad"}  # over tolerance, non-finite
    assert all('class="cw-marker"' in body for _l, body in rows)  # the tolerance tick
    range_chart = text.split('data-chart="numerics-range"')[1].split("</svg>")[0]
    # f16's largest value is 65504, just under 2^16: the tick sits at log2(65504) on the axis
    assert "2^16" in range_chart and "margin 2^1.1" in range_chart
    assert "First non-finite value made by <code>mlp.down</code> in aten.mm" in text
    assert "CW301" in text


def test_bars_sit_where_their_values_are_on_a_log_axis() -> None:
    from castwise.report._svg import Bar, bar_chart

    svg = bar_chart("t", [Bar("a", 2.0**4, "a"), Bar("b", 2.0**8, "b", marker=2.0**16)], "log2", "t")
    widths = [float(w) for w in re.findall(r'class="cw-bar cw-k-" x="\d+" y="\d+" width="([\d.]+)"', svg)]
    # axis 2^3 .. 2^16 (one step below the smallest value): a is 1/13 of the way, b 5/13 (460 px axis)
    assert widths[0] == pytest.approx(460 / 13, abs=0.2) and widths[1] == pytest.approx(5 * 460 / 13, abs=0.2)
    assert not math.isnan(widths[1])


def test_a_lint_report_renders_settings_and_no_tree() -> None:
    report = Report(
        findings=[
            Finding(
                "CW201",
                "bf16 weights with fp32 gradients",
                settings=("MIXED_PRECISION", "--gradient_precision"),
                locations=("config.env:3",),
            )
        ]
    )
    text = report.to_html()
    assert "MIXED_PRECISION, --gradient_precision" in text and "config.env:3" in text
    assert 'class="cw-tree"' not in text


def test_notebook_form_is_one_scoped_element(audit_report: Report) -> None:
    frag = audit_report._repr_html_()
    assert frag.startswith('<div class="cw-report" id="cw-report-') and frag.endswith("</div>")
    assert "<html" not in frag and "<body" not in frag
    # two reports in one notebook get two ids, so each script drives its own report
    ids = {
        re.match(r'<div class="cw-report" id="([^"]+)"', render_fragment(audit_report)).group(1)  # type: ignore[union-attr]
        for _ in range(2)
    }
    assert len(ids) == 2


def test_write_html_writes_the_page_and_refuses_bad_paths(tmp_path: Path, audit_report: Report) -> None:
    target = tmp_path / "report.html"
    assert write_html(audit_report, target) == str(target)
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    with pytest.raises(HtmlWriteError, match="does not exist") as missing:
        write_html(audit_report, tmp_path / "nope" / "r.html")
    assert isinstance(missing.value, CastwiseError)
    with pytest.raises(HtmlWriteError, match="is a folder"):
        write_html(audit_report, tmp_path)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(HtmlWriteError, match="not writable"):
            write_html(audit_report, locked / "r.html")


def test_render_refuses_what_is_not_a_report() -> None:
    with pytest.raises(TypeError, match="Report or its to_dict"):
        render_html(42)
