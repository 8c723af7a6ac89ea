"""Reports in Jupyter: ``_repr_html_`` is what a cell shows, and a real kernel shows it."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch
from IPython.core.formatters import DisplayFormatter
from nbclient import NotebookClient
from torch import nn

import castwise
from castwise.report import Report


class _UpToF32(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


@pytest.fixture(scope="module")
def report() -> Report:
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), _UpToF32(), nn.Linear(4, 2))
    return castwise.audit(model, torch.randn(2, 4, dtype=torch.bfloat16), mode="eval")


def test_repr_html_shows_findings_and_module_tree(report: Report) -> None:
    html = report._repr_html_()
    assert html.startswith('<div class="cw-report"')
    assert 'data-code="CW120"' in html  # the silent up-cast, as a finding
    for name in ("0", "1", "2"):
        assert f'data-node="{name}"' in html
    assert 'data-chart="activation-bytes"' in html


def test_ipython_displays_a_report_as_html(report: Report) -> None:
    data, _meta = DisplayFormatter().format(report)
    assert "text/html" in data and 'data-code="CW120"' in data["text/html"]
    assert data["text/plain"]  # a plain-text form for consoles too


def test_a_notebook_cell_that_ends_with_a_report_shows_it(tmp_path: Path) -> None:
    source = textwrap.dedent("""
        import torch
        from torch import nn
        import castwise

        class UpToF32(nn.Module):
            def forward(self, x):
                return x.float()

        model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), UpToF32(), nn.Linear(4, 2))
        castwise.audit(model, torch.randn(2, 4, dtype=torch.bfloat16), mode="eval")
    """)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    html = [o["data"]["text/html"] for o in outputs if o.get("output_type") == "execute_result"]
    assert len(html) == 1, outputs
    assert re.match(r'<div class="cw-report" id="cw-report-\d+-\d+">', html[0])
    assert 'data-code="CW120"' in html[0] and 'data-node="1"' in html[0]
