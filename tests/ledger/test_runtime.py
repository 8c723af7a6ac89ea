"""The ledger of a run: the audit's optimizer step (optimizer=, --optimizer) and the script's own
steps under castwise run (CW150-CW152), with controls that stay clean."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import castwise
from castwise.cli import main
from castwise.errors import AuditError
from castwise.ledger.runtime import StepProbe, watch_steps
from tests.ledger.builders import KahanAdamW, WideStateAdam

SCRIPTS = Path(__file__).parent / "scripts"


def _mlp(dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)).to(dtype)
    return model, torch.randn(4, 64, dtype=dtype)


def _codes(report: castwise.Report) -> list[str]:
    return [f.code for f in report.findings]


@pytest.mark.parametrize("fake", [True, False])
def test_audit_step_names_the_stalled_group_only(fake: bool) -> None:
    model, x = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters(), "lr": 1e-5}]
    )
    report = castwise.audit(model, x, optimizer=opt, fake=fake, mode="train")
    (f,) = [f for f in report.findings if f.code == "CW150"]
    assert dict(f.details)["params"] == ("2.weight", "2.bias")  # group 1 (lr 1e-5), not group 0 (lr 1e-2)
    assert "param group 1 (lr=1e-05)" in f.message and "0.weight" not in f.message
    rows = report.to_dict()["ledger"]["rows"]
    assert {r["state"]["value"] for r in rows} == {"bfloat16"}
    # the user's model and optimizer are as they were
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_audit_step_controls_stay_clean() -> None:
    model, x = _mlp(torch.float32)
    # f32 weights under bf16 autocast: the f32 parameters are the master copy
    r = castwise.audit(model, x, policy="bf16-mixed", optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-5})
    assert "CW150" not in _codes(r)
    assert r.to_dict()["ledger"]["rows"][0]["storage"]["value"] == "float32"
    # bf16 weights with a learning rate whose step is above bf16 spacing
    bf, xb = _mlp()
    r = castwise.audit(bf, xb, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-1}, mode="train")
    assert "CW150" not in _codes(r)
    # bf16 weights with Kahan-compensated updates: one step leaves most weights, on purpose
    r = castwise.audit(bf, xb, optimizer=KahanAdamW, optimizer_kwargs={"lr": 1e-5}, mode="train")
    assert "CW150" not in _codes(r)
    assert r.to_dict()["ledger"]["rows"][0]["rounding"]["value"] == "kahan"


def test_audit_step_follows_the_policy_and_the_real_gradients() -> None:
    model, x = _mlp(torch.float32)
    # bf16-true casts the weights: the same f32 model now stalls at lr 1e-5 (the run's dtypes, not the user's)
    r = castwise.audit(model, x, policy="bf16-true", optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-5})
    assert "CW150" in _codes(r)
    # SGD's step scales with the gradient: only a real run's own gradients say whether it rounds away
    bf, xb = _mlp()
    fake = castwise.audit(bf, xb, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 1e-6}, mode="train")
    real = castwise.audit(bf, xb, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 1e-6}, mode="train", fake=False)
    assert "CW150" not in _codes(fake) and "CW150" in _codes(real)
    big = castwise.audit(bf, xb, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 10.0}, mode="train", fake=False)
    assert "CW150" not in _codes(big)


def test_audit_step_resume_and_meta() -> None:
    model, x = _mlp()
    r = castwise.audit(model, x, optimizer=lambda m: WideStateAdam(m.parameters(), lr=1e-1), mode="train")
    assert "CW151" in _codes(r)
    r = castwise.audit(model, x, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-1}, mode="train")
    assert "CW151" not in _codes(r)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)).bfloat16()
    r = castwise.audit(meta, torch.randn(2, 64, dtype=torch.bfloat16), optimizer=torch.optim.AdamW, mode="train")
    rows = r.to_dict()["ledger"]["rows"]
    assert rows[0]["state"]["value"] == "bfloat16" and "CW150" not in _codes(r)  # dtypes, no values


def test_audit_optimizer_arguments_are_checked() -> None:
    model, x = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(AuditError, match=r"optimizer_kwargs= goes with a torch\.optim class"):
        castwise.audit(model, x, optimizer=opt, optimizer_kwargs={"lr": 1.0})
    with pytest.raises(AuditError, match=r"give a torch\.optim class"):
        castwise.audit(model, x, optimizer="AdamW")
    with pytest.raises(AuditError, match="mode='train' or 'both'"):
        castwise.audit(model, x, optimizer=opt, mode="eval")


def test_cli_audit_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{Path(__file__).parent / 'builders.py'}:bf16_mlp"
    main(["audit", target, "--policy", "bf16-true", "--optimizer", "torch.optim.AdamW", "--lr", "1e-5", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert "CW150" in {f["code"] for f in data["findings"]} and data["ledger"]["rows"]
    assert main(["audit", target, "--lr", "1e-5"]) == 2
    assert "--lr and --optimizer-kwargs go with --optimizer" in capsys.readouterr().err


def _train(model: nn.Module, opt: torch.optim.Optimizer, micro: int, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        for _ in range(micro):
            model(torch.randn(8, 64, generator=gen).to(dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_probe_reads_the_scripts_steps_without_changing_them() -> None:
    model, _ = _mlp()
    twin = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    probe = StepProbe(names=lambda p: names.get(id(p)))
    with watch_steps(probe):
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-5), micro=128)
    _train(twin, torch.optim.AdamW(twin.parameters(), lr=1e-5), micro=128)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))
    (ledger,) = probe.ledgers
    assert [f.code for f in ledger.findings] == ["CW150", "CW152"]
    assert dict(ledger.findings[1].details)["micro_batches"] == 128
    assert all(not p._backward_hooks for p in model.parameters())  # hooks removed


def test_probe_controls_f32_grads_and_few_micro_batches() -> None:
    model, _ = _mlp()
    for p in model.parameters():
        p.grad_dtype = torch.float32  # gradients accumulate in f32
    probe = StepProbe()
    with watch_steps(probe):  # (torch's Adam refuses f32 gradients for bf16 weights; SGD adds them)
        _train(model, torch.optim.SGD(model.parameters(), lr=1.0), micro=128)
    assert [f.code for f in probe.ledgers[0].findings] == []
    model, _ = _mlp()
    probe = StepProbe()
    with watch_steps(probe):
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-1), micro=8)  # 8 bf16 micro-batches: fine
    assert [f.code for f in probe.ledgers[0].findings] == []


def test_castwise_run_reports_the_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["run", "--json", str(out), str(SCRIPTS / "accumulate_bf16.py")]) == 0
    err = capsys.readouterr().err
    assert "CW150" in err and "CW152" in err and "param group 1" in err
    data = json.loads(out.read_text())
    assert [m["model"] for m in data["models"]] == ["Sequential"]
    assert {f["code"] for f in data["ledgers"][0]["findings"]} == {"CW150", "CW152"}
    assert main(["run", "--json", str(out), str(SCRIPTS / "accumulate_bf16.py"), "--fixed"]) == 0
    assert "CW15" not in capsys.readouterr().err
    assert json.loads(out.read_text())["ledgers"][0]["findings"] == []


def test_html_report_has_the_ledger_table() -> None:
    model, x = _mlp()
    report = castwise.audit(model, x, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-5}, mode="train")
    page = report.to_html()
    assert 'id="ledger"' in page and "<th>state</th>" in page and ">bf16</td>" in page
    assert 'id="ledger"' not in castwise.audit(model, x, mode="train").to_html()  # no optimizer: no ledger


def test_cw153_f16_adam_goes_nonfinite_and_f32_state_does_not() -> None:
    model, x = _mlp(torch.float16)
    for fake in (True, False):
        r = castwise.audit(model, x, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 1e-4}, mode="train", fake=fake)
        assert "CW153" in _codes(r)
    probe = StepProbe()
    with watch_steps(probe):
        _train(model, torch.optim.Adam(model.parameters(), lr=1e-4), micro=1)
    assert "CW153" in [f.code for f in probe.ledgers[0].findings]
    assert not all(bool(torch.isfinite(p).all()) for p in model.parameters())  # the truth: real NaN
    # controls: f16 weights with SGD (no state to underflow), and f32 weights under f16 autocast
    f16, _ = _mlp(torch.float16)
    probe = StepProbe()
    with watch_steps(probe):
        _train(f16, torch.optim.SGD(f16.parameters(), lr=1.0), micro=1)
    assert [f.code for f in probe.ledgers[0].findings] == []
    f32, x32 = _mlp(torch.float32)
    r = castwise.audit(f32, x32, policy="16-mixed", optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 1e-4})
    assert "CW153" not in _codes(r)


def test_probe_steps_from_the_state_an_optimizer_makes_at_construction() -> None:
    # Adagrad makes its state in __init__: the f32 twin of the step starts from it
    model, _ = _mlp()
    probe = StepProbe()
    with watch_steps(probe):
        _train(model, torch.optim.Adagrad(model.parameters(), lr=1e-5), micro=1)
    assert "CW150" in [f.code for f in probe.ledgers[0].findings]


def test_meta_audit_steps_one_parameter_of_each_kind_and_rows_name_them_all() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8)).bfloat16()
    model[2].float()

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": m[:3].parameters()}, {"params": m[3].parameters(), "lr": 1e-6}])

    report = castwise.audit(model, torch.randn(2, 64, dtype=torch.bfloat16), optimizer=adamw, mode="train")
    rows = report.to_dict()["ledger"]["rows"]
    assert sorted(n for r in rows for n in r["params"]) == sorted(n for n, _ in model.named_parameters())
    by_param = {n: (r["storage"]["value"], r["state"]["value"]) for r in rows for n in r["params"]}
    assert by_param["1.weight"] == ("bfloat16", "bfloat16") and by_param["2.weight"] == ("float32", "float32")


def _ln_mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    layers = (nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    model = nn.Sequential(*layers)
    return model.to(dtype)


def _sgd_run(model: nn.Module, steps: int, probe: StepProbe | None = None) -> None:
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    dtype = next(model.parameters()).dtype
    with watch_steps(probe) if probe is not None else contextlib.nullcontext():
        for _ in range(steps):
            model(torch.randn(16, 32, generator=gen).to(dtype)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def test_cw150_measures_the_movement_missed_not_the_elements_left() -> None:
    """f16 SGD at lr 1.0: the first step leaves most changing elements of the LayerNorm weight as they
    were, yet over 20 real steps it misses little of the f32 run's movement: no CW150."""
    start = _ln_mlp(torch.float16)
    w0 = start[1].weight.detach().float().clone()
    one, ref = copy.deepcopy(start), copy.deepcopy(start).float()
    _sgd_run(one, 1)
    _sgd_run(ref, 1)
    moved = ref[1].weight.detach() != w0
    left = moved & (one[1].weight.detach().float() == w0)
    assert float(left.sum() / moved.sum()) > 0.5  # what the first-step share of elements read
    low, ref = copy.deepcopy(start), copy.deepcopy(start).float()
    _sgd_run(low, 20)
    _sgd_run(ref, 20)
    want = ref[1].weight.detach()
    gap = float((low[1].weight.detach().float() - want).norm() / (want - w0).norm())
    assert gap < 0.5  # the real 20-step truth: it trains
    probe = StepProbe()
    _sgd_run(copy.deepcopy(start), 6, probe)
    assert [f.code for f in probe.ledgers[0].findings] == []
    # the same weights at lr 1e-5 miss everything: named
    probe = StepProbe(names=lambda p: "w")  # one name for all: told apart by their places
    stalled = _ln_mlp(torch.float16)
    with watch_steps(probe):
        _train_steps(stalled, torch.optim.SGD(stalled.parameters(), lr=1e-5), 6)
    (f,) = probe.ledgers[0].findings
    assert f.code == "CW150" and "w (100%), group0.1 (100%)" in f.message


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(16, 32, generator=gen).half()).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _grad_f32_head() -> tuple[nn.Module, torch.Tensor]:
    model, x = _mlp()
    for p in model[2].parameters():
        p.grad_dtype = torch.float32  # the head's gradients accumulate in f32; the body's stay bf16
    return model, x


@pytest.mark.parametrize("fake", [True, False])
def test_cw154_adamw_refuses_f32_grads_for_bf16_weights(fake: bool) -> None:
    model, x = _grad_f32_head()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-3}]
    r = castwise.audit(model, x, optimizer=torch.optim.AdamW(groups), mode="train", fake=fake)
    (f,) = [f for f in r.findings if f.code == "CW154"]
    details = dict(f.details)
    assert details["groups"] == (1,) and details["params"] == ("2.weight", "2.bias")
    assert "param.grad_dtype = torch.float32" in f.message and "exp_avg, exp_avg_sq bf16" in f.message
    assert details["fixes_verified"][0].startswith("f32 master weights") and "foreach=False: fails" in f.fix
    assert r.to_dict()["ledger"]["rows"]  # storage and gradient known, the rest unknown
    assert all(p.grad is None for p in model.parameters())
    # the fix the finding names, run for real: f32 weights (the master copy) under bf16 autocast
    master = nn.Sequential(*(copy.deepcopy(m).float() for m in model))
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    with torch.autocast("cpu", torch.bfloat16):
        master(x.float()).float().sum().backward()
    opt.step()
    assert all(bool(p.isfinite().all()) for p in master.parameters())


def test_cw154_controls_sgd_takes_f32_grads_and_adamw_same_dtype() -> None:
    model, x = _grad_f32_head()
    r = castwise.audit(model, x, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 1e-1}, mode="train")
    assert "CW154" not in _codes(r)
    plain, xb = _mlp()
    r = castwise.audit(plain, xb, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-1}, mode="train")
    assert "CW154" not in _codes(r)


def test_cw154_castwise_run_reports_before_the_scripts_step_raises(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", str(SCRIPTS / "grad_dtype_adam.py")])
    err = capsys.readouterr().err
    assert "CW154" in err and "param group 1 (lr=0.001)" in err and "f32 master weights" in err
    assert code != 0  # the script's own step still raises, after the finding
    assert main(["run", str(SCRIPTS / "grad_dtype_adam.py"), "--fixed"]) == 0
    assert "CW154" not in capsys.readouterr().err


def test_text_report_shows_the_ledger_one_row_per_group(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{Path(__file__).parent / 'builders.py'}:bf16_mlp"
    args = ["audit", target, "--policy", "bf16-true", "--optimizer", "torch.optim.AdamW", "--lr", "1e-5"]
    main([*args, "--json", "-"])
    groups = json.loads(capsys.readouterr().out)["ledger"]["rows"]
    main(args)
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("ledger (the audit with torch.optim.adamw.AdamW"))
    assert out[at + 1].split()[:4] == ["params", "storage", "compute", "grad"]
    rows = [line for line in out[at + 2 :] if line.strip()]
    assert len(rows) == len(groups) == 2  # one line per group, as the JSON's rows (the f32 norm apart)
    for line, group in zip(rows, groups, strict=True):
        first = group["params"][0]
        assert line.split()[0] == first and f"{'bf16' if group['storage']['value'] == 'bfloat16' else 'f32'}" in line


def test_cw154_castwise_ledger_of_a_model_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build = tmp_path / "gd.py"
    build.write_text(
        "import torch\nfrom torch import nn\n\n\ndef build():\n"
        "    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).bfloat16()\n"
        "    for p in m.parameters():\n        p.grad_dtype = torch.float32\n"
        "    return m, torch.randn(2, 8).bfloat16()\n"
    )
    assert main(["ledger", f"{build}:build", "--json", "-"]) == 1  # an error finding
    data = json.loads(capsys.readouterr().out)
    assert [f["code"] for f in data["findings"]] == ["CW154"]
    (row,) = data["rows"]
    assert (row["storage"]["value"], row["gradient"]["value"], row["state"]["value"]) == (
        "bfloat16",
        "float32",
        "unknown",
    )
    assert main(["ledger", f"{build}:build", "--optimizer", "torch.optim.SGD", "--json", "-"]) == 0  # SGD adds them
    assert json.loads(capsys.readouterr().out)["findings"] == []
