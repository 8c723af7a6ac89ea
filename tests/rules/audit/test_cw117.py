"""CW117: a complex tensor cast to a real dtype in forward. The truth is the real CPU run of the
same model: its output differs from the same weights with the table kept complex; the controls
(the table kept complex, its real view cast, `.real` taken on purpose) get no finding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import castwise


class _Rope(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.wq = nn.Linear(8, 8)
        self.how = how
        angles = torch.outer(torch.arange(4.0), torch.linspace(0.1, 1.0, 4))
        self.register_buffer("freqs_cis", torch.polar(torch.ones(4, 4), angles), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.wq(x)
        z = torch.view_as_complex(q.float().reshape(*q.shape[:-1], 4, 2))
        f = self.freqs_cis
        if self.how == "type_as":  # the bug: the table cast with the activations
            f = f.type_as(q)
        elif self.how == "copy_into_real":  # the bug again, through a preallocated real buffer
            f = torch.empty(f.shape, dtype=q.dtype).copy_(f)
        elif self.how == "real_view":  # fine: the real view is cast, the table stays complex
            return (torch.view_as_real(z * f).to(q.dtype) + torch.view_as_real(f).to(q.dtype).sum()).flatten(-2)
        elif self.how == "real_part":  # fine: the real part taken on purpose
            return torch.view_as_real(z * f).flatten(-2).type_as(q) + f.real.sum().to(q.dtype)
        return torch.view_as_real(z * f).flatten(-2).type_as(q)


def _drops_imaginary(how: str, x: torch.Tensor) -> bool:
    # the real run against the same weights with the table kept complex (torch's own warning is
    # TORCH_WARN_ONCE: it shows once per process, so the outputs are the truth)
    bug, ok = _Rope(how), _Rope("none")
    ok.load_state_dict(bug.state_dict())
    return bool((bug(x) - ok(x)).abs().max() > 1e-2)


@pytest.mark.parametrize("policy", ["bf16-true", "bf16-mixed", None])
@pytest.mark.parametrize("how", ["type_as", "copy_into_real"])
def test_a_complex_table_made_real_is_found_where_the_real_run_drops_its_imaginary_part(
    how: str, policy: str | None
) -> None:
    x = torch.randn(2, 4, 8)
    assert _drops_imaginary(how, x)  # with no policy too: f32 activations, and the table becomes real
    report = castwise.audit(_Rope(how), (x,), policy=policy)
    found = [f for f in report.findings if f.code == "CW117"]
    assert len(found) == 1, str(report)
    f = found[0]
    assert f.module == "" and f.origin is not None and "freqs_cis" in (f.origin.tensor or "")
    assert "c64[4, 4]" in f.message and "imaginary part" in f.message
    assert f.severity == "warning" and not report.errors


@pytest.mark.parametrize("how", ["none", "real_view", "real_part"])
def test_a_table_kept_complex_or_its_real_view_cast_is_clean(how: str) -> None:
    x = torch.randn(2, 4, 8)
    report = castwise.audit(_Rope(how), (x,), policy="bf16-true")
    assert not [f for f in report.findings if f.code == "CW117"], str(report)


def _after_lightning(precision: str) -> torch.dtype:
    """The complex buffer's dtype after Lightning Fabric's own conversion (its precision plugin's
    convert_module, run by ``fabric.setup``) on CPU: the truth the policy models."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    return fabric.setup_module(_Rope("none")).module.freqs_cis.dtype


def test_lightnings_true_conversion_making_a_complex_buffer_real_is_found() -> None:
    # issue 39: Lightning's bf16-true runs module.to(bf16), which casts complex buffers too; castwise's
    # bf16-true keeps them complex, so the lightning: policy must convert as Lightning does
    assert not _after_lightning("bf16-true").is_complex
    report = castwise.audit(_Rope("none"), (torch.randn(2, 4, 8),), policy="lightning:bf16-true")
    found = [f for f in report.findings if f.code == "CW117"]
    assert len(found) == 1 and not report.errors, str(report)
    f = found[0]
    assert f.origin is not None and f.origin.tensor == "buffer freqs_cis"
    assert "module.to(bf16)" in f.message and "c64[4, 4]" in f.message and "convert_module" in f.message
    assert "plain attribute" in (f.fix or "")


@pytest.mark.parametrize(
    "policy, lightning", [("lightning:64-true", "64-true"), ("lightning:bf16-mixed", "bf16-mixed")]
)
def test_conversions_that_keep_complex_buffers_complex_are_clean(policy: str, lightning: str) -> None:
    # look-alikes: 64-true converts with module.double() (floating tensors only), *-mixed converts nothing
    assert _after_lightning(lightning).is_complex
    report = castwise.audit(_Rope("none"), (torch.randn(2, 4, 8),), policy=policy)
    assert not [f for f in report.findings if f.code == "CW117"], str(report)


def test_castwise_apply_under_lightning_true_is_undone_bit_for_bit() -> None:
    m = _Rope("none")
    before = m.freqs_cis.clone()
    applied = castwise.apply(m, "lightning:bf16-true")
    assert m.freqs_cis.dtype == torch.bfloat16  # as Lightning's module.to(bf16) leaves it
    applied.remove()
    assert m.freqs_cis.dtype == torch.complex64 and torch.equal(m.freqs_cis, before)
