"""The device registry: CPU classes chosen by capability, GPUs by compute capability, one list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import castwise
from castwise import devices

SRC = Path(castwise.__file__).parent


class TransposedUp(nn.Module):
    """A decoder's upsampling conv kept in bf16 with its bias left in f32: the kernel path decides.

    An AVX-512 CPU sends the bf16 transposed convolution to oneDNN, which refuses the f32 bias; an
    AVX2 CPU runs the native kernel, which adds it (measured: tests/trace/truth/)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 3, 3)
        self.up.weight.data = self.up.weight.data.bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x).float().sum()


def _real_run_raises(model: nn.Module, x: torch.Tensor) -> bool:
    try:
        model(x).backward()
    except RuntimeError:
        return True
    return False


def test_the_audit_follows_the_cpu_class_it_is_asked_for() -> None:
    model, x = TransposedUp(), torch.randn(1, 2, 6, 6, dtype=torch.bfloat16)
    avx2 = castwise.audit(model, x, device="cpu:avx2", mode="train")
    avx512 = castwise.audit(model, x, device="cpu:avx512", mode="train")
    assert avx2.ok, avx2.errors
    assert [f.module for f in avx512.errors] == ["up"]
    assert "bias type" in avx512.errors[0].message


def test_the_host_cpu_audit_agrees_with_this_machines_real_run() -> None:
    model, x = TransposedUp(), torch.randn(1, 2, 6, 6, dtype=torch.bfloat16)
    report = castwise.audit(model, x, device="cpu", mode="train")
    assert report.ok == (not _real_run_raises(TransposedUp(), x))
    assert devices.get("cpu").caps == devices.host_cpu().caps


def test_a_device_index_means_the_device_and_unknown_names_list_the_valid_ones() -> None:
    assert devices.get("cuda:0") is devices.get("cuda")
    assert devices.get("cpu:0") is devices.host_cpu()
    with pytest.raises(
        castwise.CastwiseError, match=r"'cpu:avx9' is not one castwise can simulate; valid: cpu, cpu:amx"
    ):
        devices.get("cpu:avx9")


def test_gpus_are_values_of_the_registry_by_compute_capability() -> None:
    assert devices.get("cuda").capability == (9, 0)
    assert devices.get("cuda:a100").capability == (8, 0)
    assert devices.get("cuda:t4").capability == (7, 5)
    assert all(devices.get(n).kernels == "cuda" for n in devices.names() if n.startswith("cuda"))


def test_a_real_audit_refuses_a_cpu_class_this_machine_is_not() -> None:
    here = devices.host_variant()
    other = "cpu:avx2" if here != "cpu:avx2" else "cpu:avx512"
    with pytest.raises(castwise.AuditError, match=rf"not those of {other}"):
        castwise.audit(TransposedUp(), torch.randn(1, 2, 6, 6, dtype=torch.bfloat16), device=other, fake=False)


def test_no_device_list_is_written_by_hand_outside_the_registry() -> None:
    # every --device choice derives from devices.names() (cli.DeviceChoice)
    pattern = re.compile(r"Choice\(\[\s*\"cpu\"")
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == [], offenders
