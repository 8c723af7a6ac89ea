"""Differential test of the dtype-contract table's CUDA rules against real CUDA kernels.

The CUDA rules were read from PyTorch's kernel sources and are what a simulated-CUDA audit
(``castwise.audit(..., device="cuda")`` on a machine without a GPU) relies on. Here every case of
contract_cases.py runs on a real CUDA device: the table's ``cuda`` prediction must match the
kernel (raise or not, and the result dtype), and when both raise the table's message must be the
kernel's own first line. Runs only where torch sees a CUDA device (``pytest -m gpu``).
"""

from __future__ import annotations

import pytest
import torch

from castwise.trace.contracts import check

from .contract_cases import Case, Outcome, all_cases, make_for, on_device, predict, run_detail

pytestmark = pytest.mark.gpu

CASES = all_cases()

# Cases where the table knowingly differs from real CUDA kernels, and why (kept as small as the
# CPU list: each entry is a measured difference with its reason, never a way to silence a rule).
ALLOWED: dict[str, tuple[Outcome, str]] = {}

# Families whose CUDA messages come from a backend library (cuDNN, cuBLAS) rather than a dtype
# check, so the table words them as the dtype rule it enforces instead.
OWN_WORDING = {"convolution", "convolution_backward", "gelu"}


def _family(case: Case) -> str:
    return case.id.split("[", 1)[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_table_predicts_real_cuda_kernel(case: Case) -> None:
    predicted = predict(case, "cuda")
    if case.id in ALLOWED:
        assert predicted == ALLOWED[case.id][0]
        return
    real, message = run_detail(case, "cuda")
    assert predicted == real, f"{case.id}: real CUDA kernel -> {real} ({message}), table -> {predicted}"
    if not real.raised or _family(case) in OWN_WORDING:
        return
    args, kwargs = on_device(make_for(case, "cuda"), "cuda")
    violation = check(case.func, args, kwargs, "cuda")
    assert violation is not None
    assert message is not None and message.startswith(violation.message), (
        f"{case.id}: kernel says {message!r}, table says {violation.message!r}"
    )


def test_cases_ran_on_a_real_cuda_device() -> None:
    # the differential means nothing if the tensors stayed on the CPU
    args, kwargs = on_device(CASES[0].make(), "cuda")
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    assert tensors and all(t.is_cuda for t in tensors)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_a_16_bit_batch_norm_with_f32_stats_is_refused_in_its_spatial_training_backward(low: torch.dtype) -> None:
    """nn.BatchNorm with its parameters in the input's 16-bit dtype and running statistics left
    in f32 (as DeepSpeed's and FSDP2's parameter casts leave it): forward runs, the training
    backward of a spatial input is refused, a (N, C) input runs both (the table's rule on
    native_batch_norm_backward)."""
    for shape, refused in (((2, 4, 3, 3), True), ((2, 4), False)):
        bn = (torch.nn.BatchNorm2d(4) if len(shape) == 4 else torch.nn.BatchNorm1d(4)).cuda()
        bn.weight.data, bn.bias.data = bn.weight.data.to(low), bn.bias.data.to(low)
        x = torch.randn(*shape, device="cuda", dtype=low, requires_grad=True)
        y = bn(x)
        assert y.dtype == low
        if refused:
            with pytest.raises(RuntimeError, match="Expected running_mean to have type"):
                y.float().sum().backward()
        else:
            y.float().sum().backward()
