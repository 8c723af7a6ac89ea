"""The HTML report in a real browser: headless Chromium opens each file offline and the tests look.

The five stories, a Llama audit (the 7B benchmark's shape, smaller) and a numerics report:
findings, module names and charts render, selecting a finding reveals its origin (also in a
folded tree), search narrows the tree, and no console error and no network request occur.
A missing Chromium fails these tests (CI installs it: Debian's `chromium` package).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from castwise.report._chromium import Chromium, find_chromium
from castwise.report.html import render_html
from tests.report._reports import llama_report, numerics_data, story_report

PAGES = ["story1", "story2", "story3", "story4", "story5", "llama", "numerics"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    if find_chromium() is None:
        pytest.fail(
            "headless Chromium is needed for the HTML report tests and was not found: install it "
            "(Debian: apt-get install chromium; the README's test command does) or set CASTWISE_CHROMIUM"
        )
    with Chromium(width=1280, height=900) as b:
        yield b


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("html")
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    for name in PAGES:
        report: Any
        if name.startswith("story"):
            report = story_report(int(name[-1]))
        elif name == "llama":
            report = llama_report()
        else:
            report = numerics_data()
        data = report if isinstance(report, dict) else report.to_dict()
        path = folder / f"{name}.html"
        path.write_text(render_html(report), encoding="utf-8")
        out[name] = (path, data)
    return out


def _open(browser: Chromium, path: Path) -> None:
    browser.open(str(path))
    assert browser.eval("document.querySelector('.cw-report').getAttribute('data-ready')") == "1"


def _clean(browser: Chromium, path: Path) -> None:
    assert browser.log.errors == [], browser.log.errors
    outside = [u for u in browser.log.requests if not u.startswith("data:") and u != path.resolve().as_uri()]
    assert outside == [], outside


VISIBLE = "(e => !!e && e.checkVisibility() && e.getClientRects().length > 0)"


@pytest.mark.parametrize("name", PAGES)
def test_the_page_renders_findings_modules_and_charts_with_no_error_and_no_request(
    browser: Chromium, pages: dict[str, tuple[Path, dict[str, Any]]], name: str
) -> None:
    path, data = pages[name]
    _open(browser, path)
    codes = browser.eval(
        "[...document.querySelectorAll('.cw-finding')].filter(e => e.checkVisibility())"
        ".map(e => e.querySelector('code').textContent)"
    )
    assert codes == [f["code"] for f in data["findings"]]
    text = browser.eval("document.body.innerText")
    if not codes:  # a clean audit says so
        assert "No findings." in text and "no findings" in text
    for f in data["findings"]:
        assert f["message"].split()[0] in text
    modules = data["summary"].get("modules", [])
    nodes = browser.eval("[...document.querySelectorAll('.cw-node')].map(e => e.getAttribute('data-node'))")
    assert nodes == [m["name"] for m in modules]
    if modules:  # the top of the tree is on screen, with its class names
        shown = browser.eval(
            f"[...document.querySelectorAll('.cw-tree > .cw-node > .cw-row, .cw-tree > .cw-node > "
            f"summary')].filter({VISIBLE}).map(e => e.innerText)"
        )
        assert shown and modules[0]["type"] in shown[0]
    charts = browser.eval(
        "[...document.querySelectorAll('svg.cw-chart')].map(s => [s.getAttribute('data-chart'),"
        " s.getBoundingClientRect().width, s.querySelectorAll('rect.cw-bar').length])"
    )
    expected = ({"params-by-dtype", "activation-bytes"} if modules else set()) | (
        {"numerics-error", "numerics-range"} if data.get("numerics") else set()
    )
    assert {c[0] for c in charts} == expected
    assert all(width > 100 and bars > 0 for _n, width, bars in charts)
    _clean(browser, path)


@pytest.mark.parametrize("name", ["story2", "story3", "story4"])
def test_selecting_a_finding_reveals_its_origin_in_a_folded_tree(
    browser: Chromium, pages: dict[str, tuple[Path, dict[str, Any]]], name: str
) -> None:
    path, data = pages[name]
    _open(browser, path)
    index, finding = next((i, f) for i, f in enumerate(data["findings"]) if f["origin"] and f["origin"]["module"])
    origin = finding["origin"]["module"]
    row = (
        f"(() => {{const n = document.querySelector('.cw-node[data-node={json.dumps(origin)}]');"
        "return n.tagName === 'DETAILS' ? n.querySelector(':scope > summary') "
        ": n.querySelector(':scope > .cw-row');})()"
    )
    browser.click(".cw-collapse")
    if "." in origin:  # folded: the origin's row is out of sight
        assert not browser.eval(f"{VISIBLE}({row})")
    browser.click(f".cw-finding[data-index='{index}']")
    assert browser.eval(f"{VISIBLE}({row})")
    assert browser.eval(f"{row}.classList.contains('cw-is-origin')")
    box = browser.eval(f"(r => [r.top, r.bottom])({row}.getBoundingClientRect())")
    tree = browser.eval("(r => [r.top, r.bottom])(document.querySelector('.cw-tree').getBoundingClientRect())")
    assert tree[0] - 1 <= box[0] and box[1] <= tree[1] + 1  # scrolled into the tree's view
    assert box[0] >= 0 and box[1] <= browser.eval("innerHeight")  # and the tree into the window's
    at = finding["module"]
    assert browser.eval(
        f"document.querySelector('.cw-node[data-node={json.dumps(at)}]')"
        ".querySelector('.cw-row, summary').classList.contains('cw-is-at')"
    )
    on_path = browser.eval(
        "[...document.querySelectorAll('.cw-on-path')].map(e => e.closest('.cw-node').getAttribute('data-node'))"
    )
    assert origin in on_path and at in on_path
    bar = browser.eval("document.querySelector('.cw-pathbar').textContent")
    assert bar.startswith(finding["code"]) and origin in bar
    _clean(browser, path)


def test_search_narrows_the_tree_to_matches_and_their_ancestors(
    browser: Chromium, pages: dict[str, tuple[Path, dict[str, Any]]]
) -> None:
    path, _data = pages["llama"]
    _open(browser, path)
    browser.click(".cw-search")
    browser.send("Input.insertText", {"text": "layers.1.mlp.down"})
    visible = browser.eval(
        "[...document.querySelectorAll('.cw-node')].filter(e => !e.hidden && "
        "e.checkVisibility()).map(e => e.getAttribute('data-node'))"
    )
    assert visible == [
        "",
        "model",
        "model.layers",
        "model.layers.1",
        "model.layers.1.mlp",
        "model.layers.1.mlp.down_proj",
    ]
    assert browser.eval("document.querySelector('.cw-count').textContent") == "1 match"
    browser.eval("(i => {i.value = ''; i.dispatchEvent(new Event('input'));})(document.querySelector('.cw-search'))")
    assert browser.eval("[...document.querySelectorAll('.cw-node')].filter(e => e.hidden).length") == 0
    _clean(browser, path)


def test_pins_in_the_tree_select_their_finding(
    browser: Chromium, pages: dict[str, tuple[Path, dict[str, Any]]]
) -> None:
    path, _data = pages["story4"]
    _open(browser, path)
    browser.click(".cw-pin-origin")
    selected = browser.eval("[...document.querySelectorAll('.cw-finding.cw-selected')].map(e => e.dataset.code)")
    assert selected == ["CW104"]
    _clean(browser, path)


def test_the_harness_sees_console_errors_exceptions_and_requests(browser: Chromium, tmp_path: Path) -> None:
    # the checks above are only as good as what the browser reports: a page that does all three
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><body><div class="cw-report" data-ready="1"></div>'
        '<img src="http://127.0.0.1:9/x.png"><script>console.error("boom");'
        "undefinedFunction();</script></body></html>",
        encoding="utf-8",
    )
    browser.open(str(page))
    assert any("boom" in e for e in browser.log.errors)
    assert any("undefinedFunction" in e for e in browser.log.errors)
    assert "http://127.0.0.1:9/x.png" in browser.log.requests
