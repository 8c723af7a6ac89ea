"""Silent precision loss (issue 34): CW120's containment and CW140-CW142, each held against the
values measured for real on CPU (the 16-bit result against float32 on the same inputs), with the
look-alikes that are fine."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import castwise
from tests.rules.fixtures.CW140_loss_in_bf16 import TinyLM, build


class _Head(nn.Module):
    """torchtitan's loss: the logits made float32 before cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h).float()


class _TitanLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = _Head()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(x)), y)


class _Policy(nn.Module):
    """An RL policy's log-probabilities: float32 logits divided by a temperature, then log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = _Head()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x)) / 0.7
        return torch.log_softmax(logits, -1).gather(-1, y[:, None]).squeeze(-1)


class _Spreads(nn.Module):
    """The float32 of the head goes on through a later layer: a real up-cast."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _Head()
        self.after = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.head(x)
        return F.cross_entropy(self.after.float()(out), y)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 16, dtype=torch.bfloat16), torch.randint(0, 8, (4,))


def _codes(report: castwise.Report, prefix: str) -> list[tuple[str, str | None]]:
    return [(f.code, f.module) for f in report.findings if f.code.startswith(prefix)]


def test_cw120_is_quiet_where_the_float32_feeds_only_a_loss_or_log_softmax() -> None:
    for model in (_TitanLM(), _Policy()):
        model.to(torch.bfloat16)
        for device in ("cpu", "cuda"):
            report = castwise.audit(model, _inputs(), mode="both", device=device)
            assert _codes(report, "CW120") == [], str(report)


def test_cw120_still_fires_where_the_float32_reaches_a_later_layer() -> None:
    model = _Spreads().to(torch.bfloat16)
    report = castwise.audit(model, _inputs(), mode="eval")
    assert ("CW120", "head") in _codes(report, "CW120"), str(report)


def _ce_finding(report: castwise.Report) -> castwise.Finding:
    hits = [f for f in report.findings if f.code == "CW140"]
    assert len(hits) == 1, str(report)  # one finding for the chain log_softmax -> nll_loss
    return hits[0]


def test_cw140_cross_entropy_on_bf16_logits_under_bf16_true() -> None:
    model, inputs = build()
    for device, op in (("cuda", "aten.nll_loss_forward"), ("cpu", "aten.nll_loss_forward")):
        f = _ce_finding(castwise.audit(model, inputs, policy="bf16-true", mode="both", device=device))
        assert (f.module, f.op) == ("", op)
        assert f.origin is not None and f.origin.module == "lm_head"
        assert "out[lm_head]=f32" in (f.fix or "")
        assert f.modes == ("train", "eval")


def test_cw140_estimate_matches_the_real_rounding_and_the_fix_removes_it() -> None:
    model, inputs = build()
    report = castwise.audit(model, inputs, policy="bf16-true", mode="eval", device="cpu")
    f = _ce_finding(report)
    est = dict(f.details)["estimated_error"]
    # measured: the same bf16 logits, log-probabilities in bf16 against float32
    logits = model.lm_head(model.norm(model.embed(inputs[0]))).detach().to(torch.bfloat16).flatten(0, 1)
    exact = torch.log_softmax(logits.float(), -1)
    err = (torch.log_softmax(logits, -1).float() - exact).abs().max().item()
    assert est / 4 <= err <= est * 2, (est, err)
    # the finding's fix, run for real: the loss of the same bf16 model is then computed in float32
    assert "out[lm_head]=f32" in (f.fix or "") and "output=f32" in (f.fix or "")
    ref = model(*inputs).item()
    errors = []
    for policy in ("bf16-true", "bf16-true,out[lm_head]=f32,output=f32"):
        m = copy.deepcopy(model)
        castwise.apply(m, policy)
        with torch.no_grad():
            errors.append(abs(m(*inputs).item() - ref))
    assert errors[1] * 4 <= errors[0], errors
    assert _codes(castwise.audit(model, inputs, policy="bf16-true,out[lm_head]=f32", device="cuda"), "CW14") == []


def test_cw140_controls_autocast_an_f32_island_and_float32_are_clean() -> None:
    model, inputs = build()
    for policy in ("bf16-mixed", "bf16-true,out[lm_head]=f32", "fp32", None):
        for device in ("cpu", "cuda"):
            report = castwise.audit(model, inputs, policy=policy, mode="both", device=device)
            assert _codes(report, "CW14") == [], (policy, device, str(report))


def test_cw140_names_no_op_whose_kernel_is_as_good_as_float32() -> None:
    # softmax, layer_norm and sum of bf16 compute in float32 and round once: not reported
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.q(x))
            return torch.softmax(h @ h.T, -1).sum()

    report = castwise.audit(Attn(), torch.randn(4, 16), policy="bf16-true", mode="both", device="cuda")
    assert _codes(report, "CW14") == [], str(report)


def test_tiny_lm_is_the_fixture_model() -> None:
    assert isinstance(build()[0], TinyLM)


def test_cw142_router_top_k_on_bf16_probabilities_and_the_measured_flips() -> None:
    model, inputs = _router()
    report = castwise.audit(model, inputs, policy="bf16-true", mode="eval", device="cuda")
    hits = [f for f in report.findings if f.code == "CW142"]
    assert [(f.module, f.op) for f in hits] == [("moe", "aten.topk")], str(report)
    assert "keep[moe]=f32" in (hits[0].fix or "")
    # measured: the same bf16 gate, probabilities in bf16 against float32; the bf16 router picks
    # other experts (ties broken by the rounding) for some tokens, the float32 one as float32 does
    gate = model.moe.gate.to(torch.bfloat16)
    x = torch.randn(4096, 16).to(torch.bfloat16)
    with torch.no_grad():
        logits = gate(x)
        low = torch.softmax(logits, -1).topk(2, -1).indices.sort(-1).values
        exact = torch.softmax(logits.float(), -1).topk(2, -1).indices.sort(-1).values
    flipped = (low != exact).any(-1).float().mean().item()
    assert flipped > 0.001, flipped


def test_cw142_controls_a_float32_router_is_clean() -> None:
    model, inputs = _router()
    for policy in ("fp32", "bf16-true,keep[moe]=f32"):
        report = castwise.audit(model, inputs, policy=policy, mode="eval", device="cuda")
        assert _codes(report, "CW14") == [], (policy, str(report))


def _router() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from tests.rules.fixtures.CW142_router_in_bf16 import build as build_router

    return build_router()


def _rotary_scores(pos: torch.Tensor, inv: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    from tests.rules.fixtures.CW141_positions_type_as import rotate

    freqs = torch.outer(pos.float(), inv.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return rotate(q, emb.cos(), emb.sin()) @ rotate(k, emb.cos(), emb.sin()).T


def test_cw141_positions_type_as_a_bf16_buffer_and_the_measured_phases() -> None:
    from tests.rules.fixtures.CW141_positions_type_as import build as build_rotary

    model, inputs = build_rotary()
    report = castwise.audit(model, inputs, policy="bf16-true", mode="eval", device="cuda")
    hits = [f for f in report.findings if f.code == "CW141"]
    assert [(f.module, f.op) for f in hits] == [("attn.rotary", "aten.mul")], str(report)
    assert hits[0].origin is not None and hits[0].origin.module == "attn.rotary"
    assert "CW141_positions_type_as.py:24" in (hits[0].source or "")
    assert "steps of 16" in hits[0].message  # bf16 spacing at 3000
    # measured: rotary attention scores at positions 3000-3063, against float32. Positions rounded to
    # bf16 (the finding) move them far more than the inv_freq table rounded to bf16 with the phase
    # still computed in float32 from exact positions (the control: a relative error only)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)
    pos, inv = inputs[1], model.attn.rotary.inv_freq
    exact = _rotary_scores(pos, inv, q, k)
    rounded = (_rotary_scores(pos.to(torch.bfloat16), inv, q, k) - exact).abs().max().item()
    table = (_rotary_scores(pos, inv.to(torch.bfloat16), q, k) - exact).abs().max().item()
    assert rounded > 4 * table, (rounded, table)


def test_cw141_controls_positions_kept_exact_are_clean() -> None:
    from tests.rules.fixtures.CW141_positions_type_as import build as build_rotary

    cases = [
        (build_rotary(f32_phase=True), "bf16-true"),  # float32 phase, type_as on the result
        (build_rotary(start=0), "bf16-true"),  # positions 0-63: exact in bf16
        (build_rotary(), "bf16-mixed"),  # the buffer stays float32
        (build_rotary(), "fp32"),
    ]
    for (model, inputs), policy in cases:
        for device in ("cpu", "cuda"):
            report = castwise.audit(model, inputs, policy=policy, mode="eval", device=device)
            assert _codes(report, "CW141") == [], (policy, device, str(report))


class _Timestep(nn.Module):
    """A sinusoidal timestep embedding (diffusers' get_timestep_embedding)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.dim = dim
        self.mlp = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freqs = torch.exp(-9.21 * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp.weight.dtype))


def test_cw141_a_float_timestep_cast_by_the_engine_input_cast() -> None:
    inputs = (torch.tensor([937.5, 621.9]),)
    report = castwise.audit(_Timestep(), inputs, policy="bf16-true", mode="eval", device="cuda")
    hits = [f for f in report.findings if f.code == "CW141"]
    assert [(f.module, f.op) for f in hits] == [("", "aten.mul")], str(report)
    assert hits[0].origin is not None and "`t`" in (hits[0].origin.tensor or ""), hits[0].origin
    # controls: an integer timestep is never cast; small float timesteps are exact enough in bf16
    for clean in (torch.tensor([937, 622]), torch.tensor([0.5, 0.25])):
        report = castwise.audit(_Timestep(), (clean,), policy="bf16-true", mode="eval", device="cuda")
        assert _codes(report, "CW141") == [], str(report)


class _MaskPositions(nn.Module):
    """Positions from a padding mask's running count, then a rotary phase."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        pos = (mask.cumsum(-1) - 1).clamp(min=0).long()
        freqs = pos[0].float()[:, None] * self.inv_freq.float()[None]
        return freqs.cos().sum() + freqs.sin().sum()


def test_cw141_positions_counted_in_bf16_name_the_cumsum() -> None:
    mask = torch.ones(1, 1024)
    report = castwise.audit(_MaskPositions(), (mask,), policy="bf16-true", mode="eval", device="cuda")
    hits = [f for f in report.findings if f.code == "CW141"]
    assert [f.op for f in hits] == ["aten.cumsum"], str(report)
    assert "`mask`" in (hits[0].origin.tensor or "") if hits[0].origin else False
    # measured: the bf16 running count of 1024 ones is rounded to the bf16 grid above 256 (steps of
    # 2 to 4), so most positions there are another position's; float32 counts exactly
    count = torch.ones(1024, dtype=torch.bfloat16).cumsum(0).float()
    wrong = (count != torch.arange(1, 1025).float()).float().mean().item()
    assert wrong > 0.3, wrong
    # controls: an integer mask counts exactly; a short one (200) is exact in bf16
    for clean in (torch.ones(1, 1024, dtype=torch.long), torch.ones(1, 200)):
        report = castwise.audit(_MaskPositions(), (clean,), policy="bf16-true", mode="eval", device="cuda")
        assert _codes(report, "CW141") == [], str(report)


class _Router2(nn.Module):
    """Float32 router probabilities cast back to bf16 before top-k (``type_as``), or float32 sigmoid
    scores plus a DeepSeek-style expert-bias buffer that the policy stores in bf16."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.gate = nn.Linear(16, 8, bias=False)
        self.register_buffer("e_score_correction_bias", 0.3 + 0.02 * torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "type_as":
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32).type_as(x)
        elif self.how == "kept_f32":  # the control: the f32 probabilities go to top-k as they are
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        else:
            scores = torch.nn.functional.linear(x.float(), self.gate.weight.float()).sigmoid()
            probs = scores + self.e_score_correction_bias
        return probs.topk(2, dim=-1).values.sum()


@pytest.mark.parametrize("how", ["type_as", "bias"])
def test_cw142_probabilities_cast_back_or_a_bf16_bias_added_before_top_k(how: str) -> None:
    report = castwise.audit(_Router2(how), (torch.randn(4, 16),), policy="bf16-true")
    assert [c for c, _ in _codes(report, "CW142")] == ["CW142"], str(report)


def test_cw142_controls_float32_probabilities_and_an_f32_bias_are_clean() -> None:
    assert not _codes(castwise.audit(_Router2("kept_f32"), (torch.randn(4, 16),), policy="bf16-true"), "CW142")
    assert not _codes(castwise.audit(_Router2("bias"), (torch.randn(4, 16),), policy="fp32"), "CW142")


class _LogSoftmaxOverDim1(nn.Module):
    """Log-probabilities taken over dim 1 of (batch, classes, tokens), as a loss written for
    ``cross_entropy``'s layout does: 256 classes, 1024 tokens on the last axis."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 256)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(self.head(x).transpose(1, 2), dim=1)
        return logp.gather(1, t[:, None]).mean()


def test_cw140_sizes_log_probabilities_by_the_axis_log_softmax_reduces() -> None:
    """|log p| is about ln(classes) along the axis log_softmax normalises (dim 1 here), not the last
    axis (the 1024 tokens): the stated size and error follow the op's own dim."""
    torch.manual_seed(0)
    x, t = torch.randn(2, 1024, 16), torch.randint(0, 256, (2, 1024))
    report = castwise.audit(_LogSoftmaxOverDim1(), (x, t), policy="bf16-true", device="cuda", mode="train")
    (f,) = [f for f in report.findings if f.code == "CW140"]
    assert f.op == "aten._log_softmax"
    assert dict(f.details)["magnitude"] == pytest.approx(math.log(256))


class _FluxTimestep(nn.Module):
    """torchtitan's FLUX ``timestep_embedding``: timesteps in [0, 1] times ``time_factor`` 1000, then
    the sinusoidal phases, into the ``time_in`` MLP."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.dim = dim
        self.time_in = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def phases(self, timesteps: torch.Tensor) -> torch.Tensor:
        t = 1000.0 * timesteps
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
        return t[:, None].float() * freqs[None]

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        args = self.phases(timesteps)
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if torch.is_floating_point(timesteps):
            emb = emb.to(timesteps)
        return self.time_in(emb)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cw141_a_timestep_rounded_by_the_fsdp2_input_cast_then_scaled_by_the_model(device: str) -> None:
    timesteps = torch.tensor([0.9382, 0.32176])
    report = castwise.audit(_FluxTimestep(), (timesteps,), policy="fsdp2:bf16", mode="eval", device=device)
    hits = [f for f in report.findings if f.code == "CW141"]
    assert [(f.module, f.op) for f in hits] == [("", "aten.mul")], str(report)
    f = hits[0]
    assert f.origin is not None and "`timesteps`" in (f.origin.tensor or "")
    assert "multiplied by" in f.message and "steps of 4 " in f.message, f.message
    # measured: the phases of the bf16-cast timesteps against float32 ones, at the highest frequency
    # (1 rad per unit): 0.9382 is bf16 0.9375, and x1000 in bf16 rounds 937.5 again (steps of 4)
    model = _FluxTimestep()
    moved = (model.phases(timesteps.to(torch.bfloat16)) - model.phases(timesteps)).abs().max().item()
    assert 0.5 < moved <= dict(f.details)["step"], (moved, f.details)


def test_cw141_controls_integer_and_small_timesteps_and_no_input_cast() -> None:
    cases = [
        (torch.tensor([937, 322]), "fsdp2:bf16"),  # integer timesteps: never cast
        (torch.tensor([0.001, 0.002]), "fsdp2:bf16"),  # x1000 still far below one unit of rounding
        (torch.tensor([0.9382, 0.32176]), "bf16-mixed"),  # the timesteps stay float32
    ]
    for timesteps, policy in cases:
        report = castwise.audit(_FluxTimestep(), (timesteps,), policy=policy, mode="eval", device="cuda")
        assert _codes(report, "CW141") == [], (timesteps, policy, str(report))


class _GridInBf16(nn.Module):
    """Rotary positions made by an arange in the table's (bf16) dtype: their size is the last
    position, n - 1, not the axis length n."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device, dtype=self.inv_freq.dtype)
        return self.proj(x) * torch.outer(pos, self.inv_freq).cos().sum()


def test_cw141_sizes_an_arange_by_its_last_position() -> None:
    report = castwise.audit(_GridInBf16(), torch.randn(1, 1024, 8), policy="bf16-true", mode="eval")
    (f,) = [f for f in report.findings if f.code == "CW141"]
    assert dict(f.details)["step"] == 4.0 and "steps of 4 " in f.message, f.message
    # measured: positions 0-1023 made in bf16 are off by at most 2 (half of 4), not 4 (half of 8)
    made = torch.arange(1024, dtype=torch.bfloat16).double()
    assert (made - torch.arange(1024).double()).abs().max().item() == 2.0
    # controls: a table of 256 positions (0-255) is exact in bf16; 257 reach 256, a step of 2
    assert _codes(castwise.audit(_GridInBf16(), torch.randn(1, 256, 8), policy="bf16-true", mode="eval"), "CW141") == []
    assert _codes(castwise.audit(_GridInBf16(), torch.randn(1, 257, 8), policy="bf16-true", mode="eval"), "CW141")


class _LitgptRouter(nn.Module):
    """litgpt's LLaMAMoE router: top-k on the gate's logits, then the softmax of the k chosen."""

    def __init__(self, argmax: bool = False) -> None:
        super().__init__()
        self.argmax = argmax
        self.gate = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router = self.gate(x)
        if self.argmax:  # a look-alike: one prediction per row, no routing
            return x * router.argmax(-1, keepdim=True)
        probs, indices = torch.topk(router, 2)
        probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        return x * probs.sum(-1, keepdim=True) + indices.sum() * 0


class _LitgptMoe(nn.Module):
    def __init__(self, argmax: bool = False) -> None:
        super().__init__()
        self.moe = _LitgptRouter(argmax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


@pytest.mark.parametrize("policy", ["bf16-true", "bf16-mixed"])
def test_cw142_top_k_on_bf16_router_logits_and_the_measured_flips(policy: str) -> None:
    torch.manual_seed(0)
    report = castwise.audit(_LitgptMoe(), (torch.randn(32, 16),), policy=policy, mode="eval", device="cuda")
    hits = [f for f in report.findings if f.code == "CW142"]
    assert [(f.module, f.op) for f in hits] == [("moe", "aten.topk")], str(report)
    assert "logits" in hits[0].message and "keep[moe]=f32" in (hits[0].fix or "")
    # measured: top-k on the bf16 logits against top-k on the same product in float32 (the bf16
    # gate, 4096 tokens): the bf16 router sends some tokens to another pair of experts, about as
    # often as top-k on bf16 probabilities does (test above)
    gate = _LitgptRouter().gate.to(torch.bfloat16)
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        low = gate(x).topk(2, -1).indices.sort(-1).values
        exact = (x.float() @ gate.weight.float().T).topk(2, -1).indices.sort(-1).values
    assert (low != exact).any(-1).float().mean().item() > 0.0005


def test_cw142_controls_a_float32_router_and_an_argmax_on_logits_are_clean() -> None:
    x = (torch.randn(32, 16),)
    for policy in ("fp32", "bf16-true,keep[moe]=f32", "bf16-mixed,keep[moe]=f32"):
        report = castwise.audit(_LitgptMoe(), x, policy=policy, mode="eval", device="cuda")
        assert _codes(report, "CW142") == [], (policy, str(report))
    report = castwise.audit(_LitgptMoe(argmax=True), x, policy="bf16-true", mode="eval", device="cuda")
    assert _codes(report, "CW142") == [], str(report)
