"""``castwise numerics TARGET --html FILE``: the offline HTML report of a numerics run."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from castwise.cli.numerics import numerics_command

FIXTURES = Path(__file__).parents[1] / "rules" / "fixtures"


def _run(name: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(numerics_command, [f"{FIXTURES / name}:build", *args])
    return result.exit_code, result.output


def test_forecast_html_charts_every_module_against_the_target(tmp_path: Path) -> None:
    page = tmp_path / "forecast.html"
    code, out = _run("CW310_attention_scores_f16.py", "--forecast", "f16", "--html", str(page), "--json", "-")
    assert code == 0, out
    rows = json.loads(out)["numerics"]
    assert {"attn", "attn.q", "attn.k"} <= {r["module"] for r in rows}
    assert all(r["dtype"] == "f16" for r in rows)
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and 'id="numerics"' in text
    assert "CW310" in text and 'data-module="attn"' in text
    # offline: no address the browser would fetch
    assert not re.search(r"(src|href)=\"https?://", text)
    # the attention scores pass 65504: their bar is marked bad against f16's limit; q's is not
    chart = text[text.index('id="numerics"') :]
    assert re.search(
        r'data-label="attn"><title>[^<]*</title><text[^>]*>[^<]*</text><rect class="cw-bar cw-k-bad"', chart
    )
    assert not re.search(
        r'data-label="attn.q"><title>[^<]*</title><text[^>]*>[^<]*</text><rect class="cw-bar cw-k-bad"', chart
    )


def test_locate_html_marks_the_producer(tmp_path: Path) -> None:
    page = tmp_path / "locate.html"
    code, out = _run("CW301_fp16_wo_overflow.py", "--locate", "--html", str(page))
    assert code == 1, out
    text = page.read_text(encoding="utf-8")
    assert "First non-finite value made by" in text and "CW301" in text


def test_html_to_a_missing_folder_fails_before_the_run(tmp_path: Path) -> None:
    code, out = _run("CW310_attention_scores_f16.py", "--forecast", "f16", "--html", str(tmp_path / "no" / "r.html"))
    assert code == 2 and "does not exist" in out


def test_layerwise_goes_with_forecast_only() -> None:
    code, out = _run("CW302_log_of_zero.py", "--locate", "--layerwise")
    assert code == 2 and "--layerwise goes with --forecast" in out


def test_layerwise_forecast_from_the_cli_says_how_it_ran(tmp_path: Path) -> None:
    builder = tmp_path / "build_llama.py"
    builder.write_text(
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,\n"
        "                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)\n"
        "    ids = torch.randint(0, 64, (1, 8))\n"
        "    return LlamaForCausalLM(cfg), {'input_ids': ids, 'labels': ids}\n",
        encoding="utf-8",
    )
    result = CliRunner().invoke(
        numerics_command, [f"{builder}:build", "--forecast", "f16", "--layerwise", "--json", "-"]
    )
    assert result.exit_code == 0, result.output
    how = json.loads(result.stdout)["summary"]["numerics"]["layerwise"]
    assert how["blocks"] == 2 and how["first"] == "model.layers.0"
