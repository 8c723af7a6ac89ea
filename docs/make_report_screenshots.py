"""Make the screenshots in docs/images/ of the HTML report (headless Chromium, 1280x900).

    python docs/make_report_screenshots.py [--layers 32]

Story 4 and story 2 with their first finding selected (the path from origin to where it shows),
the numerics charts (a hand-built report in the documented shape) and a 7B Llama audit's tree.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: tests.report._reports

from tests.report._reports import llama_report, numerics_data, story_report  # noqa: E402

from castwise.report._chromium import Chromium  # noqa: E402
from castwise.report.html import render_html  # noqa: E402

IMAGES = os.path.join(HERE, "images")


def shoot(browser: Chromium, report: object, name: str, script: str, folder: str) -> None:
    path = os.path.join(folder, f"{name}.html")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_html(report))
    browser.open(path)
    if script:
        browser.eval(script)
    if browser.log.errors:
        raise SystemExit(f"{name}: console errors {browser.log.errors}")
    out = os.path.join(IMAGES, f"report-{name}.png")
    browser.screenshot(out)
    print(f"{out}: {os.path.getsize(out) / 1024:.0f} KiB")


SELECT_FIRST_WITH_ORIGIN = (
    "(() => {document.querySelector('.cw-collapse').click();"
    "const f = [...document.querySelectorAll('.cw-finding')].find(e => e.dataset.origin);"
    "f.click(); document.querySelector('#modules').scrollIntoView();})()"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    opts = parser.parse_args()
    os.makedirs(IMAGES, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder, Chromium(width=1280, height=900) as browser:
        shoot(browser, story_report(4), "story4-finding", "", folder)
        shoot(browser, story_report(4), "story4-path", SELECT_FIRST_WITH_ORIGIN, folder)
        shoot(browser, story_report(2), "story2-path", SELECT_FIRST_WITH_ORIGIN, folder)
        shoot(browser, numerics_data(), "numerics", "document.querySelector('#numerics').scrollIntoView()", folder)
        shoot(
            browser,
            llama_report(layers=opts.layers, small=False),
            "llama-7b",
            "document.querySelector('#modules').scrollIntoView()",
            folder,
        )


if __name__ == "__main__":
    main()
