"""castwise.audit and `castwise audit`: the rules fire where they should, stories are diagnosed
where they fail and where the dtype came from, suggested policies fix the real run."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import castwise
from castwise import auditor
from castwise.applied import apply
from castwise.auditor.findings import unsupported_dtype
from castwise.auditor.session import run_audit
from castwise.auditor.suggest import _safe_fixes
from castwise.cli import main
from castwise.errors import AuditError
from castwise.policy import Policy
from castwise.stories import STORIES, run_as_user

FIXTURES = Path(__file__).parent / "rules" / "fixtures"
AUDIT_FIXTURES = sorted(p for p in FIXTURES.glob("CW[19]*.py"))


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fixture_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_audit_rule_has_a_fixture() -> None:
    from castwise.rules import audit as audit_rules

    codes = set(audit_rules.rules())
    covered = {p.name[:5] for p in AUDIT_FIXTURES}
    assert codes == covered


@pytest.mark.parametrize("path", AUDIT_FIXTURES, ids=lambda p: p.stem)
def test_fixture_triggers_its_rule(path: Path) -> None:
    fixture = _load(path)
    model, inputs = fixture.build()
    report = castwise.audit(model, inputs, **fixture.AUDIT)
    expect = fixture.EXPECT
    hits = [f for f in report.findings if f.code == expect["code"]]
    assert hits, f"{expect['code']} not in {[f.code for f in report.findings]}"
    f = hits[0]
    if "module" in expect:
        assert f.module == expect["module"]
    if "origin" in expect:
        assert expect["origin"] in json.dumps(f.origin.to_dict() if f.origin else None)
    assert f.message and (f.fix or f.rule.fix)
    assert f.modes
    if f.level == "error":
        assert not report.ok
        # the fixture shows its rule and no other error (CW121 only says which mode failed)
        assert {x.code for x in report.errors} - {"CW121"} == {expect["code"]}


def _story(n: int) -> tuple[nn.Module, object]:
    return STORIES[n - 1].build()


def test_story1_norm_cast_down_is_found_at_ln_pre_and_fixed_by_bf16_true() -> None:
    story = STORIES[0]
    model, inputs = story.build()
    report = castwise.audit(model, inputs, policy=story.policy, device=story.device, mode="eval")
    first = report.errors[0]
    assert (first.code, first.module) == ("CW101", "visual.ln_pre")
    assert first.origin is not None and first.origin.tensor == "param visual.ln_pre.weight"
    assert report.suggested_policy is not None
    assert report.suggested_policy.compute_dtype == torch.bfloat16
    with pytest.raises(RuntimeError):
        story.run_real(model, inputs)
    apply(model, report.suggested_policy)
    story.run_real(model, inputs)  # the suggested policy makes the real CPU run pass


def test_story2_fp32_leak_names_the_failing_norm_and_the_wo_two_layers_earlier() -> None:
    story = STORIES[1]
    model, inputs = story.build()
    report = castwise.audit(model, inputs, device="cpu", mode="eval")
    leak = next(f for f in report.errors if f.code == "CW102")
    assert leak.module == story.module
    assert leak.origin is not None and leak.origin.module == story.origin
    # the silent up-cast shows where the float32 enters the stream, with activation bytes
    up = next(f for f in report.findings if f.code == "CW120")
    assert up.origin is not None and up.origin.module == story.origin
    assert report.summary["activation_bytes_by_dtype"]["float32"] > 0
    policy = report.suggested_policy
    assert policy is not None and policy.compute_dtype == torch.float16 and policy.cast_back == "saturate"
    apply(model, policy)
    story.run_real(model, inputs)


def test_story3_fails_in_eval_only_and_the_audit_fails_exactly_like_the_real_run() -> None:
    story = STORIES[2]
    model, inputs = story.build()
    # for real: training passes, validation raises, in encoder.layers.0's fused fast path
    run_as_user(model, inputs, "bf16-mixed", "train")
    with pytest.raises(RuntimeError, match="BFloat16"):
        run_as_user(model, inputs, "bf16-mixed", "eval")
    for fake in (True, False):
        report = castwise.audit(model, inputs, policy="bf16-mixed", mode="both", fake=fake)
        assert {r.mode: r.status for r in report.runs} == {"train": "ok", "eval": "error"}
        fast = next(f for f in report.errors if f.code == "CW103")
        where = (fast.module, fast.op, fast.modes)
        assert where == ("encoder.layers.0", "aten._transformer_encoder_layer_fwd", ("eval",))
        assert "BFloat16" in fast.message
        assert any(f.code == "CW121" and f.modes == ("eval",) for f in report.findings)
    assert str(report.suggested_policy) == "bf16-mixed,fastpath=off"
    applied = apply(model, report.suggested_policy)
    model.eval()
    with torch.no_grad():
        model(*inputs)  # apply enters autocast and turns the fast path off: validation passes
    applied.remove()


def test_story4_is_found_on_simulated_cuda_and_not_on_cpu() -> None:
    story = STORIES[3]
    model, inputs = story.build()
    cpu = castwise.audit(model, inputs, policy="bf16-mixed", device="cpu", mode="train")
    assert cpu.ok  # CPU autocast keeps layer_norm in bf16: a laptop never sees it
    report = castwise.audit(model, inputs, policy="bf16-mixed", device="cuda", mode="train")
    err = report.errors[0]
    assert (err.code, err.module) == ("CW104", "blocks.0.attn")
    assert err.origin is not None and err.origin.module == "blocks.0.attn.q_norm"
    assert report.runs[0].device == "cuda"
    policy = report.suggested_policy
    assert policy is not None and policy.compute_dtype == torch.bfloat16
    assert castwise.audit(model, inputs, policy=policy, device="cuda", mode="train").ok


def test_meta_device_model_audits_without_weights() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    report = castwise.audit(model, torch.randn(3, 64), policy="bf16-mixed", device="cuda")
    assert report.ok
    assert [r.device for r in report.runs] == ["cuda", "cuda"]
    assert report.summary["params_by_dtype"] == {"float32": sum(p.numel() for p in model.parameters())}
    with pytest.raises(AuditError, match="meta device"):
        castwise.audit(model, torch.randn(3, 64), fake=False)


def test_audit_reports_json_in_the_contract_shape() -> None:
    model, inputs = _story(3)
    data = castwise.audit(model, inputs, policy="bf16-mixed").to_dict()
    assert set(data) >= {"findings", "suggested_policy", "runs", "summary"}
    f = data["findings"][0]
    assert set(f) >= {"code", "name", "category", "severity", "module", "op", "origin", "modes", "message", "fix"}
    assert set(data["summary"]) >= {"params_by_dtype", "activation_bytes_by_dtype"}
    assert Policy.parse(data["suggested_policy"]).fastpath is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "validate"}, r"valid: both, eval, train"),
        ({"device": "tpu"}, r"valid: cpu, cpu:amx, .*, cuda, cuda:a100"),
        ({"policy": "bf17"}, "valid presets"),
        ({"policy": 3}, "policy must be"),
        ({"fake": "yes"}, "valid: False, True"),
        ({"device": "cuda", "fake": False}, "no CUDA device"),
    ],
)
def test_bad_arguments_raise_audit_error_naming_valid_choices(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(AuditError, match=match):
        castwise.audit(nn.Linear(2, 2), torch.randn(1, 2), **kwargs)  # type: ignore[arg-type]


def test_not_a_module_is_an_audit_error() -> None:
    with pytest.raises(AuditError, match=r"nn\.Module"):
        castwise.audit(lambda x: x, torch.randn(1))  # type: ignore[arg-type]


def test_cli_audit_exit_codes_human_report_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "target.py"
    target.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(8, 2)).to(torch.bfloat16), (torch.randn(2, 8),)

        def fine():
            return nn.Sequential(nn.Linear(8, 2)), (torch.randn(2, 8),)
    """)
    )
    out = tmp_path / "report.json"
    code = main(["audit", f"{target}:build", "--mode", "eval", "--json", str(out)])
    assert code == 1
    text = capsys.readouterr().out
    assert "error CW105 input-dtype-mismatch" in text
    data = json.loads(out.read_text())
    assert data["findings"][0]["code"] == "CW105"
    assert data["suggested_policy"] == "bf16-true"
    assert main(["audit", f"{target}:fine", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []
    assert main(["audit", f"{target}:missing"]) == 2
    assert "has no function 'missing'" in capsys.readouterr().err


def test_a_model_under_apply_is_refused_with_the_way_out() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    applied = apply(model, "bf16-true")
    with pytest.raises(AuditError, match=r"policy='bf16-true', or call .remove\(\)"):
        castwise.audit(model, torch.randn(2, 4))
    applied.remove()
    assert castwise.audit(model, torch.randn(2, 4), policy="bf16-true").ok


def test_a_callers_autocast_does_not_leak_into_a_policy_free_audit() -> None:
    fixture = _load(FIXTURES / "CW105_input_dtype.py")
    model, inputs = fixture.build()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # would hide the input mismatch if it leaked
        report = castwise.audit(model, inputs, mode="eval")
    assert [f.code for f in report.errors] == ["CW105"]


def test_cli_real_mode_and_its_limits(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{FIXTURES / 'CW103_encoder_fast_path.py'}:build"
    assert main(["audit", target, "--policy", "bf16-mixed", "--mode", "eval", "--real", "--json", "-"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["findings"][0]["code"] == "CW103"
    assert data["suggested_policy"] == "bf16-mixed,fastpath=off"
    assert main(["audit", target, "--device", "cuda", "--real"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_mask_values_are_known_so_the_fast_path_decision_matches_the_real_run() -> None:
    # padding at the start: the encoder refuses its nested fast path, each layer runs the dense
    # fused kernel, whose inner ops autocast: the real run passes, and so must the audit
    model, (x, _) = STORIES[2].build()
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[1, :3] = True
    run_as_user(model, (x, mask), "bf16-mixed", "eval")
    for fake in (True, False):
        assert castwise.audit(model, (x, mask), policy="bf16-mixed", mode="eval", fake=fake).ok


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.all():  # a branch on an input's values: fake tensors alone have none
            return self.lin(x)
        return self.lin(x) * mask.unsqueeze(-1)


def test_value_dependent_branches_on_inputs_run_in_a_fake_audit() -> None:
    report = castwise.audit(_Gate(), (torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)))
    assert report.findings == []
    assert report.summary["ops_traced"]["train"] > 0


# -- user-test regressions --------------------------------------------------------------------


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM], ids=lambda c: c.__name__)
def test_rnns_on_simulated_cuda_are_audited_not_reported_as_model_errors(cls: type[nn.RNNBase]) -> None:
    model, x = cls(8, 16, batch_first=True), torch.randn(2, 5, 8)
    for policy in (None, "16-mixed"):
        report = castwise.audit(model, x, policy=policy, device="cuda")
        assert report.findings == [] and [r.status for r in report.runs] == ["ok", "ok"], str(report)
    # the simulated cuDNN path keeps its dtype contract: f16 weights meet the f32 input
    half = cls(8, 16, batch_first=True).half()
    report = castwise.audit(half, x, device="cuda", mode="eval")
    assert [f.code for f in report.errors] == ["CW105"], str(report)


class _AsksTheDriver(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda.current_stream()  # needs the real CUDA runtime, which a fake CUDA run lacks
        return self.lin(x)


def test_touching_the_real_cuda_runtime_in_a_fake_cuda_audit_is_a_simulation_limit() -> None:
    report = castwise.audit(_AsksTheDriver(), torch.randn(2, 4), device="cuda", mode="eval")
    assert [f.code for f in report.findings] == ["CW902"] and not report.errors
    assert not report.ok  # part of the model was not checked: never ok
    assert report.findings[0].level == "warning"
    assert report.runs[0].status == "incomplete"


class _Unsupported(nn.Module):
    """cdist has no bf16/f16 kernel on CPU; it runs in the top-level forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l(x)
        return torch.cdist(y[:, None], y[:, None]).reshape(2, 1).expand(2, 4)


def test_a_real_audit_verifies_its_suggestion_on_real_tensors_and_never_respells_the_input() -> None:
    model, x = _Unsupported(), torch.randn(2, 4)
    report = castwise.audit(model, x, policy="pure_bf16", fake=False, mode="eval")
    unsupported = next(f for f in report.errors if f.code == "CW111")
    assert "bf16" in unsupported.message and unsupported.module == ""
    assert "keep[]" not in (unsupported.fix or "")  # the top level is not a selector
    suggested = report.suggested_policy
    # bf16 has no cdist kernel and no module rule reaches the top level: nothing really fixes it
    assert suggested is None, suggested


class _Spectrum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x, dim=-1).abs()


class _WithSpectrum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.spec = _Spectrum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spec(self.proj(x))


@pytest.mark.parametrize("fake", [True, False])
def test_no_kernel_for_a_dtype_is_cw111_with_an_fp32_island_fix(fake: bool) -> None:
    model, x = _WithSpectrum(), torch.randn(2, 8)
    report = castwise.audit(model, x, policy="pure_bf16", fake=fake, mode="eval")
    codes = [f.code for f in report.errors]
    assert codes == ["CW111"], str(report)
    f = report.errors[0]
    assert f.module == "spec" and "bf16" in f.message
    assert "keep[spec]=f32" in (f.fix or "")
    suggested = report.suggested_policy
    assert suggested is not None and suggested.compute_dtype == torch.bfloat16
    with apply(model, suggested):
        model(x)  # the island fixes the real run


def test_unsupported_dtype_error_texts_are_recognised() -> None:
    assert unsupported_dtype("\"cdist\" not implemented for 'BFloat16'") == torch.bfloat16
    assert unsupported_dtype("Unsupported dtype Half") == torch.float16
    assert unsupported_dtype("MKL FFT doesn't support tensors of type: BFloat16") == torch.bfloat16
    assert unsupported_dtype("linalg.inv: Low precision dtypes not supported. Got Half") == torch.float16
    assert unsupported_dtype("mat1 and mat2 must have the same dtype") is False
    assert unsupported_dtype("FakeTensor does not support meta") is False  # not a dtype: a fake limit


def test_float16_lstm_under_cpu_autocast_has_no_onednn_kernel_with_grad() -> None:
    # measured on every CPU class (tests/trace/rnn_truth.py): autocast casts the f32 input for
    # oneDNN's LSTM, which has no f16 training primitive; under no_grad only the AMX class runs it
    # (tests/trace/test_rnn_onednn.py holds every class, policy and mode)
    model, x = nn.LSTM(16, 32, batch_first=True), torch.randn(2, 7, 16)
    with pytest.raises(RuntimeError, match="primitive descriptor"), torch.autocast("cpu", dtype=torch.float16):
        model(x)
    for fake in (True, False):
        report = castwise.audit(model, x, policy="16-mixed", fake=fake, mode="train")
        assert [f.code for f in report.errors] == ["CW111"], str(report)
        assert "f16" in report.errors[0].message
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        try:
            model(x)
            runs = True
        except RuntimeError:
            runs = False
    for fake in (True, False):
        report = castwise.audit(model, x, policy="16-mixed", fake=fake, mode="eval")
        assert [f.code for f in report.errors] == ([] if runs else ["CW111"]), str(report)


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        n = int((y.detach().numpy() > 0).sum()) + 1  # values read outside torch: fake tensors have none
        return self.b(y[:n])


def test_an_incomplete_fake_run_says_so_and_how_to_check_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    report = castwise.audit(_DataDependent(), torch.randn(2, 4))
    assert [f.code for f in report.findings] == ["CW902"] and report.findings[0].level == "warning"
    assert not report.ok and not report.errors  # incomplete: never ok, though nothing is an error
    assert [r.status for r in report.runs] == ["incomplete", "incomplete"]
    assert [r["status"] for r in json.loads(report.to_json())["runs"]] == ["incomplete", "incomplete"]
    text = str(report)
    assert "train on cpu: incomplete" in text and "NOT CHECKED" in text and "--real" in text
    real = castwise.audit(_DataDependent(), torch.randn(2, 4), fake=False)
    assert real.findings == [] and [r.status for r in real.runs] == ["ok", "ok"]


@pytest.mark.parametrize("fake", [True, False])
def test_one_module_cast_by_hand_is_blamed_on_its_own_weights(fake: bool) -> None:
    model, (x,) = _load(FIXTURES / "CW113_module_cast_by_hand.py").build()
    report = castwise.audit(model, x, fake=fake)  # train: backward must not repeat the forward error
    assert [f.code for f in report.errors] == ["CW113"], str(report)
    f = report.errors[0]
    assert f.module == "b" and f.origin is not None and f.origin.tensor == "param b.weight"
    assert "`b`" in (f.fix or "") and "CW102" not in [g.code for g in report.findings]
    suggested = report.suggested_policy
    assert suggested is not None
    with apply(model, suggested):
        model(x)


class _KeptF32Head(nn.Module):
    """A bf16 model whose head was left float32 by hand: the head raises, it returns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4).to(torch.bfloat16)
        self.head = nn.Linear(4, 4)
        self.head2 = nn.Linear(4, 4).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head2(self.head(self.body(x)).to(torch.bfloat16))


def test_a_module_that_raised_is_not_said_to_return_float32() -> None:
    report = castwise.audit(_KeptF32Head(), torch.randn(2, 4, dtype=torch.bfloat16), mode="eval")
    assert [f.code for f in report.errors] == ["CW113"], str(report)
    assert not [f for f in report.findings if f.code == "CW120" and f.module == "head"], str(report)


def test_a_true_policy_on_an_ordinary_model_reports_no_tensor_off_its_dtype() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    for policy in ("bf16-true", "pure_bf16", "16-true"):
        report = castwise.audit(model, torch.randn(2, 8), policy=policy, mode="eval")
        assert report.findings == [], (policy, str(report))


class _F32Buffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.dot(self.lin(x)[0], self.table)[None]  # dot: no autocast, no promotion


def test_a_mismatch_names_the_odd_tensor_as_origin() -> None:
    report = castwise.audit(_F32Buffer(), torch.randn(2, 4), policy="bf16-mixed", mode="eval")
    err = report.errors[0]
    assert err.origin is not None and "buffer table" in (err.origin.tensor or ""), str(report)


def test_float_indices_to_an_embedding_say_indices_must_be_integers() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    report = castwise.audit(model, torch.tensor([[1.0, 2.0]]), mode="eval")
    err = report.errors[0]
    assert err.code == "CW110" and "int64" in (err.fix or "") and "destination" not in (err.fix or ""), str(report)
    assert "keep[]" not in str(report)


def test_a_model_input_is_named_as_one() -> None:
    model = nn.Linear(4, 4).to(torch.bfloat16)
    report = castwise.audit(model, torch.randn(2, 4), mode="eval")
    err = report.errors[0]
    assert err.origin is not None and err.origin.tensor == "model input `input`"
    assert "input input" not in str(report)


class _HandCastCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(8, 4, dtype=torch.bfloat16))  # bf16 by hand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cache.clone()
        c[torch.arange(2)] = x  # index_put: autocast does not cast it
        return self.lin(x).sum() + c.float().sum()


def test_under_a_mixed_policy_a_hand_cast_buffer_is_a_warning_and_the_origin_of_the_error() -> None:
    model, x = _HandCastCache(), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="Index put"), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)  # what Lightning's bf16-mixed runs
    report = castwise.audit(model, x, policy="bf16-mixed", mode="eval")
    err = next(f for f in report.errors if f.code == "CW107")
    assert err.origin is not None and "buffer cache" in (err.origin.tensor or ""), str(report)
    stray = next(f for f in report.findings if f.code == "CW122")
    assert stray.level == "warning" and "cache" in stray.message and "bf16" in stray.message


def test_cli_an_incomplete_run_exits_3_and_says_what_was_not_checked(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{FIXTURES / 'CW902_data_dependent.py'}:build"
    assert main(["audit", target, "--mode", "eval"]) == 3
    out = capsys.readouterr().out
    assert "eval on cpu: incomplete" in out and "NOT CHECKED" in out and "--real" in out
    assert main(["audit", target, "--mode", "eval", "--json", "-"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["runs"][0]["status"] == "incomplete"
    assert [f["severity"] for f in data["findings"] if f["code"] == "CW902"] == ["warning"]


def test_a_candidate_that_runs_every_op_as_before_is_never_suggested() -> None:
    # norms=f32 on a model with no norm layer is a re-spelling of pure_bf16: every op runs as before.
    # The audit's own findings never point there for this clean model, so hand suggest_policy a
    # finding that does (as a fake run that missed a real kernel's refusal would).
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    policy = Policy.parse("pure_bf16")
    report, runs = run_audit(model, x, policy, "cpu", "eval", True)
    assert report.ok
    claim = castwise.Finding(code="CW101", message="claimed", module="")
    fixed = _safe_fixes(policy, [claim], torch.bfloat16)
    assert fixed is not None and fixed != policy  # a different spelling...
    claimed = castwise.Report(findings=[claim], runs=report.runs)
    assert (
        auditor.suggest_policy(auditor.RunRequest(model, x, policy, "cpu", "eval", True), claimed, runs) is None
    )  # ...not a fix


class _WritesF32IntoCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(10, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        c = self.cache.clone()
        c[torch.arange(2)] = y.float()  # an explicit up-cast written into the (bf16) cache
        return c.sum() + y.sum()


def test_a_write_that_needs_identical_dtypes_is_cw107_not_a_norm_cast_down() -> None:
    report = castwise.audit(_WritesF32IntoCache(), torch.randn(2, 4), policy="bf16-true", mode="eval")
    assert [f.code for f in report.errors] == ["CW107"], str(report)


def _line_with(path: Path, text: str) -> int:
    """The 1-based number of the first line of ``path`` containing ``text``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_a_tensor_made_without_dtype_gets_its_line_and_the_code_change() -> None:
    fixture = _load(FIXTURES / "CW106_tensor_made_in_forward.py")
    model, inputs = fixture.build()
    (f,) = [x for x in castwise.audit(model, inputs, mode="eval").errors if x.code == "CW106"]
    line = _line_with(FIXTURES / "CW106_tensor_made_in_forward.py", "torch.ones(")
    assert f.source is not None and f.source.endswith(f"CW106_tensor_made_in_forward.py:{line}")
    assert f.code_fix is not None and f.code_fix.line == line
    assert f.code_fix.replace.strip().startswith("table = torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bfloat16)")
    data = f.to_dict()
    assert data["source"] == f.source and data["code_fix"]["line"] == line


def test_an_autocast_disabled_region_is_named_as_the_origin_and_islanded() -> None:
    fixture = _load(FIXTURES / "CW114_autocast_disabled_region.py")
    model, inputs = fixture.build()
    report = castwise.audit(model, inputs, policy="bf16-mixed", mode="train")
    (f,) = report.errors
    assert (f.code, f.module, f.origin.module if f.origin else None) == ("CW114", "router.proj", "router")
    line = _line_with(FIXTURES / "CW114_autocast_disabled_region.py", "enabled=False")
    assert f.source is not None and f.source.endswith(f"CW114_autocast_disabled_region.py:{line}")
    assert str(report.suggested_policy) == "bf16-mixed,keep[router]=f32"
    # the suggestion holds on the real CPU kernels, not only in the fake run
    fixed = castwise.apply(model, report.suggested_policy)
    try:
        model(*inputs).float().sum().backward()
    finally:
        fixed.remove()


def test_a_gradient_hook_that_changes_dtype_is_found_and_the_users_hooks_stay_as_they_were() -> None:
    fixture = _load(FIXTURES / "CW115_hook_changes_dtype.py")
    model, inputs = fixture.build()
    hooks_before = list(model.head.weight._backward_hooks.values())
    report = castwise.audit(model, inputs, mode="train")
    (f,) = report.errors
    assert (f.code, f.module) == ("CW115", "head")
    assert f.origin is not None and f.origin.tensor == "param head.weight"
    assert "clip_in_float32" in f.message and "f32 for a bf16 gradient" in f.message
    line = _line_with(FIXTURES / "CW115_hook_changes_dtype.py", "def clip_in_float32")
    assert f.source is not None and f.source.endswith(f"CW115_hook_changes_dtype.py:{line}")
    assert list(model.head.weight._backward_hooks.values()) == hooks_before
    with pytest.raises(RuntimeError, match="has changed the type of value"):  # and the real run agrees
        model(*inputs).float().sum().backward()


def test_a_forward_hook_that_changes_dtype_names_the_hooked_module() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Linear(8, 2))
    model = model.to(torch.bfloat16)

    def upcast(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        return out.float()

    model[1][0].register_forward_hook(upcast)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    report = castwise.audit(model, x, mode="eval")
    (f,) = report.errors
    assert f.code == "CW115" and f.origin is not None and f.origin.module == "1.0"
    assert "upcast" in f.message
    with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():
        model(x)


def test_a_tied_weight_is_named_after_the_module_that_ties_it_with_every_holder() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.lm_head.float()  # the user keeps the head in float32: the embedding shares its Parameter
    report = castwise.audit(model, {"input_ids": torch.randint(0, 64, (1, 8))}, mode="eval")
    first = report.errors[0]
    assert first.origin is not None and first.origin.module == "lm_head"
    assert first.origin.tensor == "param lm_head.weight (shared with model.embed_tokens.weight)"


class _Float32Island(nn.Module):
    """An island without cast-back: its input cast up, its output left float32."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.float())


class _QKVAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 2, 8).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 16)


def test_qkv_with_one_projection_kept_fp32_names_that_projection() -> None:
    # sdpa checks q/k/v before it dispatches: the operands are the last tensors the module made
    model = nn.Sequential(_QKVAttention(), nn.Linear(16, 4)).to(torch.bfloat16)
    model[0].k_proj = _Float32Island(model[0].k_proj.float())
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="query, key, and value to have the same dtype"):
        model(x)
    report = castwise.audit(model, x, mode="eval")
    (f,) = report.errors
    assert f.code == "CW102" and f.module == "0"
    assert f.origin is not None and f.origin.module == "0.k_proj.inner"
    assert "receives ," not in f.message
    assert str(report.suggested_policy) == "bf16-true,keep[*.k_proj.inner]=f32" or "k_proj" in str(
        report.suggested_policy
    )


class _RaisesKeyError(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError("not a dtype problem")


def test_an_exception_that_mentions_dtype_is_not_a_dtype_finding() -> None:
    # only a dtype error is a dtype finding: the user's exception is kept whole, with no policy fix
    report = castwise.audit(nn.Sequential(nn.Linear(4, 4), _RaisesKeyError()), torch.randn(2, 4), mode="eval")
    (f,) = report.errors
    assert (f.code, f.module) == ("CW130", "1")
    assert "KeyError: 'not a dtype problem'" in f.message
    assert report.suggested_policy is None


def test_a_finding_at_several_places_never_prints_an_empty_module_name() -> None:
    from castwise.auditor.findings import _finding
    from castwise.rules.audit._base import Diag

    f = _finding(Diag("CW110", "a", "aten.mm", None, "mixed dtypes.", "fix it."), ("eval",), ["a", "", "b"])
    assert "``" not in f.message
    assert "the model's top level" in f.message and "`b`" in f.message
