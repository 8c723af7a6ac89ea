"""CW143 (issue 34): accumulation in 16-bit, held against the error measured for real on CPU (the
bf16 loop against float64 on the same inputs), with the look-alikes that must stay clean: a
float32 accumulator, a short loop, one torch.sum, a compensated loop, residual streams of real
transformers models and a module looping over its blocks, a cumsum on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import castwise
from tests.rules.fixtures.CW143_chunked_norm_in_bf16 import build


def _cw143(report: castwise.Report) -> list[castwise.Finding]:
    return [f for f in report.findings if f.code == "CW143"]


def _silent(report: castwise.Report) -> list[tuple[str, str | None]]:
    return [(f.code, f.module) for f in report.findings if f.code.startswith("CW14")]


def test_cw143_loop_in_bf16_named_at_its_add_with_the_measured_error() -> None:
    model, inputs = build()
    report = castwise.audit(model, inputs, policy="bf16-true", mode="both", device="cuda")
    (f,) = _cw143(report)
    assert (f.op, f.module) == ("aten.add", "norm")
    assert f.origin is not None and f.origin.module == "norm"
    assert f.source is not None and "CW143_chunked_norm_in_bf16.py" in f.source
    details = dict(f.details)
    assert details["count"] == 512
    assert "keep[norm]=f32" in (f.fix or "") and "float32" in (f.fix or "")
    # measured: the same bf16 activations, the loop's sum in bf16 against float64
    x = model.proj(inputs[0]).detach().to(torch.bfloat16)
    exact = x.double().pow(2).sum(-1, keepdim=True)
    loop = model.norm.sum_of_squares(x).double()
    err = ((loop - exact).abs() / exact).max().item()
    est = details["estimated_error"]
    assert est / 4 <= err <= est * 2, (est, err)
    # the fix (a float32 accumulator), run for real, cuts it by more than 4x
    fixed = copy.deepcopy(model.norm)
    fixed.acc_f32 = True
    err_fixed = ((fixed.sum_of_squares(x).double() - exact).abs() / exact).max().item()
    assert err_fixed * 4 <= err, (err_fixed, err)
    # and the policy island the finding suggests leaves nothing to report
    assert _silent(castwise.audit(model, inputs, policy="bf16-true,keep[norm]=f32", device="cuda")) == []


@pytest.mark.parametrize(
    "norm",
    [
        {"acc_f32": True},  # the accumulator float32
        {"chunk": 64},  # 8 chunk sums added: each chunk summed by ATen in float32
        {"chunk": 512},  # one torch.sum on bf16 (accumulates in float32)
        {"kahan": True},  # the rounding of each add recovered
    ],
)
def test_cw143_controls_are_clean(norm: dict[str, int | bool]) -> None:
    model, inputs = build(**norm)  # type: ignore[arg-type]
    for device in ("cpu", "cuda"):
        report = castwise.audit(model, inputs, policy="bf16-true", mode="both", device=device)
        assert _silent(report) == [], (norm, device, str(report))


def test_cw143_controls_measured_small_against_the_bf16_loop() -> None:
    model, inputs = build()
    x = model.proj(inputs[0]).detach().to(torch.bfloat16)
    exact = x.double().pow(2).sum(-1, keepdim=True)

    def err(**norm: int | bool) -> float:
        m = copy.deepcopy(model.norm)
        for k, v in norm.items():
            setattr(m, k, v)
        return ((m.sum_of_squares(x).double() - exact).abs() / exact).max().item()

    bug = err()
    for norm in ({"acc_f32": True}, {"chunk": 64}, {"chunk": 512}, {"kahan": True}):
        assert err(**norm) * 4 <= bug, (norm, err(**norm), bug)  # type: ignore[arg-type]


class _Counts(nn.Module):
    """Per-expert token counts taken with ``index_add_`` of ones in the activation dtype."""

    def __init__(self, experts: int = 8) -> None:
        super().__init__()
        self.experts = experts
        self.proj = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = self.proj(h)
        ones = torch.ones(idx.numel(), dtype=h.dtype, device=h.device)
        counts = torch.zeros(self.experts, dtype=h.dtype, device=h.device).index_add_(0, idx, ones)
        return h * counts.sum()


def test_cw143_index_add_counts_from_known_indices_and_the_real_stall() -> None:
    idx = torch.arange(4096) % 8  # 512 tokens per expert, known to the run
    model, inputs = _Counts(), (torch.randn(2, 4), idx)
    report = castwise.audit(model, inputs, policy="bf16-true", mode="eval", device="cpu")
    (f,) = _cw143(report)
    assert f.op == "aten.index_add_" and f.module == ""
    details = dict(f.details)
    assert details["count"] == 512 and details["known_count"] is True
    # measured: bf16 counts stop at 256, as the estimate says (half of 512 lost)
    real = torch.zeros(8, dtype=torch.bfloat16).index_add_(0, idx, torch.ones(4096, dtype=torch.bfloat16))
    err = (1 - real.float() / 512).abs().max().item()
    assert err == pytest.approx(details["worst_error"], abs=0.01), (err, details)
    # few contributions per slot: clean
    few = torch.arange(64) % 8
    assert _silent(castwise.audit(model, (torch.randn(2, 4), few), policy="bf16-true", device="cpu")) == []


class _Scan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cumsum(x, dim=-1)


def test_cw143_cumsum_in_bf16_on_cuda_only() -> None:
    # CUDA's scan adds in the 16-bit dtype (aten/src/ATen/native/cuda/CumsumKernel.cu:
    # scan_dim with std::plus<scalar_t>); the CPU kernel accumulates in float (ReduceOpsKernel.cpp,
    # cumsum_cpu_kernel: at::acc_type<scalar_t, false>)
    x = torch.rand(2, 1024, dtype=torch.bfloat16)
    cuda = _cw143(castwise.audit(_Scan(), (x,), policy="bf16-true", mode="eval", device="cuda"))
    assert [(f.op, dict(f.details)["count"]) for f in cuda] == [("aten.cumsum", 1024)]
    assert _silent(castwise.audit(_Scan(), (x,), policy="bf16-true", mode="eval", device="cpu")) == []
    short = torch.rand(2, 8, dtype=torch.bfloat16)
    assert _silent(castwise.audit(_Scan(), (short,), policy="bf16-true", mode="eval", device="cuda")) == []


class _Looped(nn.Module):
    """One module loops over its blocks, adding each block's output to the stream (24 adds)."""

    def __init__(self, depth: int = 24, shared: bool = False) -> None:
        super().__init__()
        block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
        self.blocks = nn.ModuleList([block] * depth if shared else [copy.deepcopy(block) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("shared", [False, True])
def test_cw143_a_residual_stream_looped_over_blocks_is_clean(shared: bool) -> None:
    report = castwise.audit(_Looped(shared=shared), (torch.randn(2, 16),), policy="bf16-true", device="cuda")
    assert _silent(report) == [], str(report)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_cw143_real_transformers_residual_streams_are_clean(kind: str) -> None:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        model: nn.Module = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=24, n_head=2))
    else:
        cfg = tf.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=24, num_attention_heads=2
        )
        model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (1, 8))
    for device in ("cpu", "cuda"):
        report = castwise.audit(model, (ids,), policy="bf16-true", mode="both", device=device)
        assert _cw143(report) == [], (device, str(report))


class _Histogram(nn.Module):
    """A bf16 histogram of 4096 values into 8 bins, by scatter_add_ or an accumulating index_put_."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
        hist = torch.zeros(8, dtype=x.dtype, device=x.device)
        if self.how == "scatter_add":
            hist = hist.scatter_add(0, bins, x)
        else:
            hist = hist.index_put((bins,), x, accumulate=True)
        return x * hist.sum()


@pytest.mark.parametrize(("how", "op"), [("scatter_add", "aten.scatter_add"), ("index_put", "aten.index_put")])
def test_cw143_scatter_adds_reported_where_the_kernel_adds_in_16_bit(how: str, op: str) -> None:
    bins = torch.arange(4096) % 8
    x = torch.ones(4096, dtype=torch.bfloat16)
    # CUDA: atomic adds into the bf16 element (aten/src/ATen/native/cuda/Indexing.cu, ScatterGatherKernel.cu)
    (f,) = _cw143(castwise.audit(_Histogram(how), (x, bins), policy="bf16-true", mode="eval", device="cuda"))
    assert (f.op, dict(f.details)["count"]) == (op, 512)
    # CPU: reported exactly where the real kernel loses counts (512 ones per bin stopping at 256)
    lost = (_Histogram(how)(x, bins) / x)[0].item() < 8 * 512
    cpu = _cw143(castwise.audit(_Histogram(how), (x, bins), policy="bf16-true", mode="eval", device="cpu"))
    assert bool(cpu) == lost, (how, lost, cpu)
    # f32 values into an f32 histogram: clean
    f32 = castwise.audit(_Histogram(how), (x.float(), bins), policy="fp32", mode="eval", device="cuda")
    assert _silent(f32) == []
