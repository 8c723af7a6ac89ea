"""External kernels' contracts (trace/contracts/external.py) and CW160 mixed-width-into-kernel.

The packages are not installed: each test registers a custom op under the package's own op name,
as a model does when it wraps the kernel, and the contract applies by that name.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import castwise
from castwise import _releases as releases
from castwise.trace.contracts import check, is_covered, result_dtype


def _define(qualname: str, schema_args: str = "q, k, v") -> None:
    """A custom op named like the package's, that takes q/k/v (and any extras) and returns v-like."""
    ns, name = qualname.split("::")
    if hasattr(getattr(torch.ops, ns), name):
        return

    @torch.library.custom_op(qualname, mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q.float() @ k.float().transpose(-1, -2), dim=-1).to(v.dtype) @ v

    @op.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(v)


for _name in (
    "flash_attn::_flash_attn_forward",
    "flash_attn_3::fwd",
    "xformers::efficient_attention_forward_cutlass",
    "xformers_flash::flash_fwd",
    "sageattention::sageattn",
    "castwise_tests::unknown_attn",
):
    _define(_name)


def _op(qualname: str) -> torch._ops.OpOverload:
    ns, name = qualname.split("::")
    return getattr(getattr(torch.ops, ns), name).default


def _qkv(q: torch.dtype, k: torch.dtype, v: torch.dtype, head: int = 64) -> tuple[torch.Tensor, ...]:
    with FakeTensorMode():
        return tuple(torch.empty(2, 8, 4, head, dtype=d) for d in (q, k, v))


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("op", "message"),
    [
        ("flash_attn::_flash_attn_forward", "FlashAttention only support fp16 and bf16 data type"),
        ("flash_attn_3::fwd", "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type"),
        ("xformers_flash::flash_fwd", "Query/Key/Value should all have the same dtype"),
        ("sageattention::sageattn", "Input tensors must be in dtype of torch.float16 or torch.bfloat16"),
    ],
)
def test_external_attention_refuses_f32_q_beside_bf16_v_on_cuda(op: str, message: str) -> None:
    func = _op(op)
    assert is_covered(func)
    v = check(func, _qkv(F32, F32, BF16), {}, "cuda")
    assert v is not None and v.message.startswith(message)
    # the f32 operands are the culprits, the fix is v's dtype
    assert v.kind == "mismatch" and v.culprits == (0, 1) and v.expected == "bfloat16"
    # one 16-bit dtype: accepted, the result in that dtype
    assert check(func, _qkv(BF16, BF16, BF16), {}, "cuda") is None
    assert result_dtype(func, _qkv(F16, F16, F16), {}, "cuda") == F16


def test_flash_attn_all_f32_has_no_kernel_and_head_dim_is_limited() -> None:
    func = _op("flash_attn::_flash_attn_forward")
    v = check(func, _qkv(F32, F32, F32), {}, "cuda")
    assert v is not None and v.kind == "unsupported"
    big = check(func, _qkv(BF16, BF16, BF16, head=512), {}, "cuda")
    assert big is not None and "head dimension at most 256" in big.message
    mixed = check(func, _qkv(BF16, F16, BF16), {}, "cuda")
    assert mixed is not None and mixed.message == "query and key must have the same dtype"


def test_xformers_cutlass_takes_f32_but_not_a_mix() -> None:
    func = _op("xformers::efficient_attention_forward_cutlass")
    assert check(func, _qkv(F32, F32, F32), {}, "cuda") is None
    assert check(func, _qkv(F32, F32, BF16), {}, "cuda") is not None
    # xformers_flash has no f32 kernel at all
    assert check(_op("xformers_flash::flash_fwd"), _qkv(F32, F32, F32), {}, "cuda") is not None


def test_cuda_kernels_make_no_claim_on_cpu() -> None:
    func = _op("flash_attn::_flash_attn_forward")
    assert check(func, _qkv(F32, F32, BF16), {}, "cpu") is None
    assert is_covered(func)  # covered all the same: CW901 does not list it


# -- models ---------------------------------------------------------------------------------------


class QKNormAttention(nn.Module):
    """Flux-style attention: QK-RMSNorm, then an external kernel; ``cast_back`` is the fix."""

    def __init__(self, op: str, cast_back: bool = False, dim: int = 32) -> None:
        super().__init__()
        self.op, self.cast_back = op, cast_back
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = nn.RMSNorm(dim)
        self.norm_k = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = self.norm_q(q), self.norm_k(k)
        if self.cast_back:
            q, k = q.to(v.dtype), k.to(v.dtype)
        ns, name = self.op.split("::")
        return self.out(getattr(getattr(torch.ops, ns), name)(q, k, v))


def _audit(op: str, cast_back: bool = False, device: str = "cuda") -> castwise.Report:
    model = nn.Sequential(QKNormAttention(op, cast_back))
    # autocast as the newest recorded release runs it (rms_norm in f32 on CUDA, 2.12 on), on any torch
    return castwise.audit(
        model, (torch.randn(2, 8, 32),), policy="bf16-mixed", device=device, mode="eval", torch=releases.recorded()[-1]
    )


def test_registered_flash_attn_op_is_refused_at_the_norm_and_clean_with_the_cast_back() -> None:
    report = _audit("flash_attn::_flash_attn_forward")
    errors = [f for f in report.findings if f.level == "error"]
    assert [f.code for f in errors] == ["CW104"]
    assert errors[0].origin is not None and errors[0].origin.module == "0.norm_q"
    assert "FlashAttention only support fp16 and bf16" in errors[0].message
    assert not any(f.code in ("CW160", "CW901") for f in report.findings)  # the contract speaks
    fixed = _audit("flash_attn::_flash_attn_forward", cast_back=True)
    assert fixed.ok and not [f for f in fixed.findings if f.level in ("error", "warning")]


def test_cw160_mixed_widths_into_an_op_without_a_contract() -> None:
    report = _audit("castwise_tests::unknown_attn")
    hits = [f for f in report.findings if f.code == "CW160"]
    assert len(hits) == 1 and hits[0].level == "warning"
    f = hits[0]
    assert f.module == "0" and f.op == "castwise_tests.unknown_attn"
    assert f.origin is not None and f.origin.module == "0.norm_q"
    assert "rms_norm in float32" in f.message and "`0.norm_q`" in f.fix
    # the op is still listed as unchecked
    assert any(x.code == "CW901" for x in report.findings)


def test_cw160_same_widths_are_clean() -> None:
    report = _audit("castwise_tests::unknown_attn", cast_back=True)
    assert not any(f.code == "CW160" for f in report.findings)
    # no autocast: every operand f32
    model = nn.Sequential(QKNormAttention("castwise_tests::unknown_attn"))
    plain = castwise.audit(model, (torch.randn(2, 8, 32),), device="cuda", mode="eval")
    assert not any(f.code == "CW160" for f in plain.findings)


if not hasattr(torch.ops.castwise_tests, "scaled_act"):

    @torch.library.custom_op("castwise_tests::scaled_act", mutates_args=())
    def _scaled_act(x: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (x.float() * scale * weight).to(x.dtype)

    @_scaled_act.register_fake
    def _(x: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)


class ScaledAct(nn.Module):
    """Look-alikes: a bf16 activation with an f32 per-row scale (another rank) and an f32 weight
    (a parameter), as quantization and fused-norm kernels take them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.ones(1, 4, 16))  # f32 under autocast, same rank as x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # bf16 under autocast
        scale = h.float().abs().amax(dim=(-1,))  # f32, one rank less
        return torch.ops.castwise_tests.scaled_act(h, scale, self.weight)


def test_cw160_leaves_scales_and_parameters_alone() -> None:
    model = nn.Sequential(ScaledAct())
    report = castwise.audit(model, (torch.randn(2, 4, 16),), policy="bf16-mixed", device="cuda", mode="eval")
    assert not any(f.code == "CW160" for f in report.findings)


class UpcastQK(nn.Module):
    """q and k cast up by hand beside a bf16 v."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.ops.castwise_tests.unknown_attn(q.float(), k.float(), v)


def test_cw160_on_a_fake_run_only() -> None:
    model = nn.Sequential(UpcastQK()).bfloat16()
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    fake = castwise.audit(model, (x,), device="cpu", mode="eval")
    hits = [f for f in fake.findings if f.code == "CW160"]
    assert hits and hits[0].origin is not None and hits[0].origin.module == "0"
    # a real CPU run executed the op: whatever it took, it accepted
    real = castwise.audit(model, (x,), device="cpu", mode="eval", fake=False)
    assert not any(f.code == "CW160" for f in real.findings)
