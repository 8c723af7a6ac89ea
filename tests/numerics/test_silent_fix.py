"""The silent findings' fixes (CW140-CW142) verified by real runs against float32, one fix for a
chain of findings with one cause, precision declared by a clause respected only where it is
declared, and tune starting from the findings' islands."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import castwise
from castwise.errors import CastwiseError
from castwise.numerics.silent import candidates, verify_fixes, with_clause
from castwise.policy import Policy
from tests.rules.fixtures.CW140_loss_in_bf16 import build as build_lm
from tests.rules.fixtures.CW141_positions_type_as import build as build_rotary


def _silent(report: castwise.Report) -> list[castwise.Finding]:
    return [f for f in report.findings if f.code in ("CW140", "CW141", "CW142")]


def _verified(model: nn.Module, inputs: object, policy: str, mode: str = "eval") -> list[castwise.Finding]:
    report = castwise.audit(model, inputs, policy=policy, mode=mode, device="cpu")
    return _silent(verify_fixes(model, inputs, report, policy=policy, mode=mode))


class _Moe(nn.Module):
    """A router whose choice decides the output: near-tied experts (64 of them, a 16-wide input)."""

    def __init__(self, experts: int = 64) -> None:
        super().__init__()
        self.gate = nn.Linear(16, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, 16, 16))
        with torch.no_grad():  # near-tied logits, as a trained router's often are
            self.gate.weight.mul_(0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), -1)
        weights, chosen = probs.topk(2, -1)
        picked = torch.einsum("td,tkde->tke", x, self.experts[chosen])
        return (picked * weights[..., None].to(picked.dtype)).sum(1)


class _MoeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = _Moe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _moe() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return _MoeNet(), (torch.randn(512, 16),)


def test_cw140_fix_verified_by_a_real_run_against_float32() -> None:
    model, inputs = build_lm()
    before = copy.deepcopy(model.state_dict())
    (f,) = _verified(model, inputs, "bf16-true", mode="train")
    d = dict(f.details)
    assert d["fix_verified"] is True and d["fix_policy"] == "out[lm_head]=f32,output=f32", d
    assert d["error_reduction"] >= 4 and d["error_after"] * 4 <= d["error_before"], d
    assert "Verified:" in (f.fix or "") and "Not verified" not in (f.fix or ""), f.fix
    # measured here too: the same run without and with the clause, against float32
    ref = model(*inputs).item()
    errs = []
    for policy in ("bf16-true,output=f32", "bf16-true,output=f32,out[lm_head]=f32"):
        m = copy.deepcopy(model)
        castwise.apply(m, policy)
        with torch.no_grad():
            errs.append(abs(m(*inputs).item() - ref))
    assert errs[1] * 4 <= errs[0], errs
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model unchanged


def test_cw141_and_cw142_fixes_verified() -> None:
    model, inputs = build_rotary()
    (f,) = _verified(model, inputs, "bf16-true")
    assert dict(f.details)["fix_verified"] is True and dict(f.details)["fix_policy"] == "keep[attn.rotary]=f32"
    model, inputs = _moe()
    (f,) = _verified(model, inputs, "bf16-true")
    assert (f.code, dict(f.details)["fix_verified"], dict(f.details)["fix_policy"]) == (
        "CW142",
        True,
        "keep[moe]=f32",
    ), f.details


class _CodeCast(nn.Module):
    """A timestep rounded to bf16 by the model's own code: no policy clause can undo it."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(16, 16)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(torch.bfloat16)
        freqs = torch.exp(-9.21 * torch.arange(8, dtype=torch.float32) / 8).to(t.dtype)
        args = t[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp.weight.dtype))


def test_a_fix_no_clause_verifies_is_said_not_verified() -> None:
    model, inputs = _CodeCast(), (torch.tensor([937.5, 621.9, 411.3, 250.7]),)
    found = _verified(model, inputs, "bf16-true")
    assert [f.code for f in found] == ["CW141"], found
    d = dict(found[0].details)
    assert d["fix_verified"] is False and d["error_reduction"] < 4, d
    assert "Not verified" in (found[0].fix or "") and "Verified:" not in (found[0].fix or "")


class _Table(nn.Module):
    """A sinusoidal table of float positions, frequencies made in float32 in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
        freqs = pos.float()[:, None] * inv[None]
        return self.proj(torch.cat([freqs.cos(), freqs.sin()], -1).to(self.proj.weight.dtype))


class _TwoTables(nn.Module):
    """Two inputs of float positions, each into its own table: the engine's one input cast
    narrows both (two findings, one cause)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc_rotary = _Table()
        self.dec_rotary = _Table()

    def forward(self, pos: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self.enc_rotary(pos) + self.dec_rotary(other)


def test_one_fix_for_findings_of_one_cause() -> None:
    torch.manual_seed(0)
    pos = torch.arange(64).float() + 3000.0
    model, inputs = _TwoTables(), (pos, pos + 7000.0)
    report = castwise.audit(model, inputs, policy="bf16-true", mode="eval", device="cpu")
    found = _silent(verify_fixes(model, inputs, report, policy="bf16-true", mode="eval"))
    assert len(found) == 2, found
    clauses = {dict(f.details)["fix_policy"] for f in found}
    assert clauses == {"inputs=none"} and all(dict(f.details)["fix_verified"] for f in found), found
    assert all("one fix for the 2 findings" in (f.fix or "") for f in found), [f.fix for f in found]


def test_a_fake_audit_says_not_verified_and_why() -> None:
    model, inputs = build_lm()
    (f,) = _silent(castwise.audit(model, inputs, policy="bf16-true", mode="eval"))
    assert dict(f.details)["fix_verified"] is False and "fake tensors" in dict(f.details)["fix_check"]
    assert "Not verified: the audit ran on fake tensors" in (f.fix or ""), f.fix
    # weights on the meta device: nothing can run on values, and the finding says so
    with torch.device("meta"):
        meta = type(model)()
    report = castwise.audit(meta, inputs, policy="bf16-true", mode="eval")
    (g,) = _silent(verify_fixes(meta, inputs, report, policy="bf16-true", mode="eval"))
    assert dict(g.details)["fix_verified"] is False and "meta device" in dict(g.details)["fix_check"]
    assert (g.fix or "").count("Not verified") == 1, g.fix


def test_declared_precision_is_respected_only_where_declared() -> None:
    model, inputs = build_lm()

    def codes(policy: str) -> list[str]:
        return [f.code for f in _silent(castwise.audit(model, inputs, policy=policy, mode="eval", device="cuda"))]

    # whole-model presets declare nothing: bf16 cross-entropy under bf16-true is the bug
    assert codes("bf16-true") == ["CW140"]
    assert codes("bf16-true,norms=none") == ["CW140"]
    # a clause naming the module that makes the logits: declared there
    assert codes("bf16-true,out[lm_head]=bf16") == []
    assert codes("bf16-true,keep[lm_head]=bf16") == []
    # a clause naming another module declares nothing of this one
    assert codes("bf16-true,out[norm]=bf16") == ["CW140"]
    assert codes("bf16-true,keep[embed]=bf16") == ["CW140"]
    model, inputs = _moe()
    policies = {"bf16-true": ["CW142"], "bf16-true,keep[moe]=bf16": [], "bf16-true,out[moe.gate]=bf16": ["CW142"]}
    for policy, want in policies.items():
        found = [f.code for f in _silent(castwise.audit(model, inputs, policy=policy, mode="eval", device="cuda"))]
        assert found == want, (policy, found)


def test_no_candidate_island_holds_most_of_the_model() -> None:
    model, _ = build_lm()  # the embedding and the head hold half the parameters each
    f = castwise.Finding("CW141", "m", module="lm_head", origin=castwise.Origin(module="embed"))
    bf16 = Policy.parse("bf16-true")
    # an island there would "verify" by running half the model in float32: not a candidate
    assert candidates(f, bf16, model) == []
    assert candidates(f, bf16) == ["keep[lm_head]=f32", "keep[embed]=f32"]
    f = castwise.Finding("CW141", "m", module="norm", details=(("fix_policy", "inputs=none"),))
    assert candidates(f, bf16, model) == ["inputs=none", "keep[norm]=f32"]


def test_with_clause_adds_one_clause_and_refuses_a_dtype_change() -> None:
    p = with_clause(Policy.parse("bf16-true"), "inputs=none,out[lm_head]=f32")
    assert p.input_dtype is None and str(p.rules[-1]) == "out[lm_head]=f32"
    with pytest.raises(CastwiseError, match="valid: inputs=none"):
        with_clause(Policy.parse("bf16-true"), "compute=f32")


def test_tune_starts_from_the_silent_findings_islands() -> None:
    model, inputs = _moe()
    tuned = castwise.tune(model, inputs, policy="bf16-true", budget=0.2, mode="eval")
    assert tuned.candidates[0] == "moe", tuned.candidates
    assert tuned.met and "moe" in tuned.islands, tuned


def test_cross_entropy_as_f32_control_has_nothing_to_verify() -> None:
    model, inputs = build_lm()
    report = castwise.audit(model, inputs, policy="bf16-true,out[lm_head]=f32", mode="eval", device="cpu")
    assert _silent(report) == []
    assert verify_fixes(model, inputs, report, policy="bf16-true,out[lm_head]=f32", mode="eval") is report
    assert F.cross_entropy is not None


class _Timestep(nn.Module):
    """A sinusoidal timestep embedding that narrows the timestep in its own code (DiffSynth-Studio
    #1025): ``t.to(self.low)`` before the phase, so no policy clause can keep it wide."""

    def __init__(self, low: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.low = low
        self.register_buffer("freqs", torch.exp(-torch.arange(32) / 32 * 9.2), persistent=False)
        self.mlp = nn.Linear(64, 64)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.low)
        phase = t[:, None] * self.freqs.to(t.dtype)[None]
        return self.mlp(torch.cat([phase.cos(), phase.sin()], -1).to(self.mlp.weight.dtype))


class _Dit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t_embedder = _Timestep()
        self.out = nn.Linear(64, 8)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.t_embedder(t))


def test_a_cast_in_the_models_own_code_is_verified_as_the_code_change() -> None:
    """The fix is a code change: verified by running without that cast (the float32 reference
    too, since the model casts under any policy), with its module in float32."""
    torch.manual_seed(0)
    model, t = _Dit(), (torch.rand(64) * 999,)
    (f,) = _verified(model, t, "bf16-true,inputs=none", mode="train")
    d = dict(f.details)
    assert f.code == "CW141" and f.source is not None and f.source.endswith(f"{__file__.split('/')[-1]}:{_LINE}")
    assert d["fix_verified"] is True and d["fix_code"] == f"leave out the cast at {f.source}", d
    assert d["fix_policy"] == "keep[t_embedder]=f32" and d["error_reduction"] >= 4, d
    assert "the code change" in (f.fix or ""), f.fix
    # measured here too: the same code with the cast made a no-op, against float32 without it
    wide = copy.deepcopy(model)
    wide.t_embedder.low = torch.float32
    ref = wide(*t)
    errs = []
    for m, policy in (
        (model, "bf16-true,inputs=none,output=f32"),
        (wide, "bf16-true,inputs=none,output=f32,keep[t_embedder]=f32"),
    ):
        m = copy.deepcopy(m)
        castwise.apply(m, policy)
        with torch.no_grad():
            errs.append((m(*t).float() - ref).norm().item())
    assert errs[1] * 4 <= errs[0], errs


def test_a_harmless_cast_in_the_models_own_code_is_not_verified() -> None:
    """Control: timesteps small enough that bf16 holds them within the phase's tolerance (t < 1):
    leaving the cast out changes little, so the code change is not called verified."""
    torch.manual_seed(0)
    model, t = _Dit(), (torch.rand(64) * 999,)
    report = castwise.audit(model, t, policy="bf16-true,inputs=none", mode="train", device="cpu")
    small = (torch.rand(64),)
    (f,) = _silent(verify_fixes(model, small, report, policy="bf16-true,inputs=none", mode="train"))
    d = dict(f.details)
    assert d["fix_verified"] is False and d["fix_code"] == f"leave out the cast at {f.source}", d
    assert d["error_reduction"] < 4 and "Not verified: the code change" in (f.fix or ""), f.fix


_LINE = _Timestep.forward.__code__.co_firstlineno + 1
