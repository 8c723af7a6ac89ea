"""Value-dependent code on fake tensors: branches on truth values run both ways (CW903 says
which ran and whether the other was checked), ``nonzero`` gets a size, and the audit of real
transformers models with such code (BART's fp16 clamp, DeBERTa-v2) goes to the end and finds
what the real CPU run finds. An audit with a run not checked to the end is never ok."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import castwise
from castwise.cli import main
from castwise.report import Finding, Report, Run

FIXTURES = Path(__file__).parents[1] / "rules" / "fixtures"


def _codes(report: Report) -> list[str]:
    return sorted(f.code for f in report.findings if f.level != "info")


def _bart_half() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = transformers.BartConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    model: nn.Module = transformers.BartForConditionalGeneration(cfg)
    return model.half(), {"input_ids": ids, "labels": ids}


def _deberta_v2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(  # type: ignore[call-arg]
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        relative_attention=True,
        position_buckets=16,
        pos_att_type=["p2c", "c2p"],
    )
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, ::2] = -100  # the masked-LM loss selects the labelled positions
    return transformers.DebertaV2ForMaskedLM(cfg), {"input_ids": ids, "labels": labels}


def test_bart_half_runs_its_fp16_clamp_both_ways_and_matches_the_real_cpu_run() -> None:
    model, inputs = _bart_half()
    report = castwise.audit(model, inputs)
    assert [r.status for r in report.runs] == ["ok", "ok"], str(report)
    cw903 = next(f for f in report.findings if f.code == "CW903")
    branches = dict(cw903.details)["branches"]
    clamp = [b for b in branches if "isfinite" in b["source"] or "isinf" in b["source"]]
    assert clamp and all(b["other_checked"] for b in clamp), branches
    assert all(b["module"].startswith("model.encoder.layers.") for b in clamp)
    assert "both values checked" in cw903.message
    real = castwise.audit(model, inputs, fake=False)
    assert _codes(report) == _codes(real), f"{report}\n---\n{real}"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_deberta_v2_audits_to_the_end_like_the_real_cpu_run(device: str) -> None:
    model, inputs = _deberta_v2()
    report = castwise.audit(model, inputs, policy="bf16-mixed", device=device)
    assert [r.status for r in report.runs] == ["ok", "ok"], str(report)
    assert report.ok
    real = castwise.audit(model, inputs, policy="bf16-mixed", device="cpu", fake=False)
    assert _codes(report) == _codes(real)


class _ClampPath(nn.Module):
    """The rare branch (an overflow guard) holds the dtype error; the common one is clean."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.fix = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.proj(x)
        if torch.isinf(h).any():
            out: torch.Tensor = self.fix(h.double())  # f64 activations into f32 weights: the real kernel refuses
            return out
        return h


def test_an_error_on_the_side_the_first_run_did_not_take_is_found() -> None:
    report = castwise.audit(_ClampPath(), torch.randn(2, 4), mode="eval")
    assert [(f.code, f.module) for f in report.errors] == [("CW110", "fix")], str(report)
    # the real run on these values takes the common side: the error is only on the rare one
    assert not castwise.audit(_ClampPath(), torch.randn(2, 4), mode="eval", fake=False).errors
    cw903 = next(f for f in report.findings if f.code == "CW903")
    assert dict(cw903.details)["branches"][0]["taken"] == [False]
    assert dict(cw903.details)["branches"][0]["other_checked"]


class _Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)  # an activation: no values on fake tensors (an input's are known)
        while (x > 1).any():  # the second run answers True: it must still end
            x = x / 2
        return x


def test_a_loop_on_a_value_ends_in_both_runs() -> None:
    report = castwise.audit(_Loop(), torch.randn(3) * 10, mode="eval")
    assert [r.status for r in report.runs] == ["ok"], str(report)
    site = dict(next(f for f in report.findings if f.code == "CW903").details)["branches"][0]
    assert site["taken"] == [False] and site["other_checked"]


def test_a_number_from_a_value_is_assumed_and_the_run_goes_on() -> None:
    class Sized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.lin(x)
            return x[: int(x.abs().sum().item()) % 2 + 1]

    report = castwise.audit(Sized(), torch.randn(3), mode="eval")
    assert [f.code for f in report.findings] == ["CW903"], str(report)
    assert [r.status for r in report.runs] == ["ok"]
    assumed = dict(report.findings[0].details)["assumed_sizes"]
    assert [(a["op"], a["assumed"]) for a in assumed] == [
        ("aten._local_scalar_dense", "a number fake tensors have no value for taken as 1")
    ]


def test_values_read_through_numpy_still_stop_the_fake_run_and_say_so() -> None:
    class Sized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.lin(x)
            return x[: int(abs(x.detach().numpy()).sum()) % 2 + 1]

    report = castwise.audit(Sized(), torch.randn(3), mode="eval")
    assert [f.code for f in report.findings] == ["CW902"], str(report)
    assert [r.status for r in report.runs] == ["incomplete"] and not report.ok


def test_a_report_with_an_incomplete_run_is_never_ok() -> None:
    warn = Finding(code="CW902", message="stopped", modes=("eval",))
    assert not Report(findings=[warn], runs=[Run("eval", "cpu", None, "incomplete")]).ok
    assert Report(findings=[], runs=[Run("eval", "cpu", None, "ok")]).ok
    assert not Report(findings=[], runs=[Run("train", "cpu", None, "ok"), Run("eval", "cpu", None, "incomplete")]).ok


def test_cli_exit_code_is_3_for_an_incomplete_audit_and_1_when_it_also_has_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["audit", f"{FIXTURES / 'CW902_data_dependent.py'}:build", "--mode", "eval", "--json", "-"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in data["runs"]] == ["incomplete"]
    both = tmp_path / "both.py"
    both.write_text(
        "import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(4, 4)\n"
        "        self.b = nn.Linear(4, 4).half()\n\n"
        "    def forward(self, x):\n        y = self.b(self.a(x))\n"
        "        return y[: int(abs(y.detach().numpy()).sum()) % 2 + 1]\n\n\n"
        "def build():\n    return M(), (torch.randn(2, 4),)\n"
    )
    assert main(["audit", f"{both}:build", "--mode", "eval"]) == 1
    assert "incomplete" in capsys.readouterr().out
