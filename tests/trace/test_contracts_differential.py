"""Differential test of the dtype-contract table against real CPU kernels.

Every case in contract_cases.py calls one aten overload on tiny real CPU tensors; the table must
predict the outcome: whether the kernel raises, and the dtype it returns when it does not. When
both raise, the table's message must be the kernel's own (first line), and the violation must
point at operands that really have a dtype other than the one it says the kernel wanted.
"""

from __future__ import annotations

import collections

import pytest
import torch

from castwise.trace.contracts import check, tensor_args

from .contract_cases import Case, Outcome, all_cases, predict, run, run_detail

CASES = all_cases()

# Cases where the table knowingly differs from this machine's CPU kernels, and why.
ALLOWED: dict[str, tuple[Outcome, str]] = {
    # oneDNN's gelu backward fails to build a reorder primitive for an f16 grad with a bf16
    # input ("could not create a primitive descriptor for the reorder primitive"). The result
    # depends on the oneDNN build and the CPU's ISA, not on a dtype rule; the table predicts the
    # promoting TensorIterator kernel (f32), which is what every other gelu_backward mix does.
    "gelu_backward[f16-bf16]": (Outcome(False, torch.float32), "oneDNN reorder failure, ISA-dependent"),
}

# Families whose real messages come from a backend library rather than a dtype check, so the
# table words them as the dtype rule it enforces instead.
OWN_WORDING = {
    "convolution_backward",  # oneDNN: "could not create a primitive descriptor ..."
    "gelu",  # "GeluKernelImpl" not implemented for 'Long': the kernel's internal name
}


def _family(case: Case) -> str:
    return case.id.split("[", 1)[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_table_predicts_real_cpu_kernel(case: Case) -> None:
    predicted = predict(case)
    if case.id in ALLOWED:
        want, _why = ALLOWED[case.id]
        assert predicted == want
        return
    real, message = run_detail(case)
    assert predicted == real, f"{case.id}: real CPU kernel -> {real} ({message}), table -> {predicted}"
    if not real.raised:
        return
    args, kwargs = case.make()
    violation = check(case.func, args, kwargs, "cpu")
    assert violation is not None
    assert violation.op == f"aten.{case.func._opname}"
    if _family(case) not in OWN_WORDING:
        assert message is not None and message.startswith(violation.message), (
            f"{case.id}: kernel says {message!r}, table says {violation.message!r}"
        )
    flat = tensor_args(args, kwargs)
    assert all(0 <= i < len(flat) for i in violation.culprits)
    if violation.kind != "unsupported":
        assert violation.culprits, f"{case.id}: a dtype mismatch must name the operand at fault"
        if violation.expected is not None:
            assert all(_name(flat[i].dtype) != violation.expected for i in violation.culprits), (
                f"{case.id}: a culprit already has the expected dtype {violation.expected}"
            )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_cases_cover_every_family_and_enough_combinations() -> None:
    families = collections.Counter(c.family for c in CASES)
    assert len(CASES) >= 150
    for family in (
        "matmul",
        "conv",
        "norm",
        "sdpa",
        "embedding",
        "index",
        "inplace",
        "promotion",
        "backward",
        "fused",
        "softmax",
        "loss",
        "nokernel",
    ):
        assert families[family] >= 5, f"family {family!r} has only {families[family]} cases"
    # raising and accepting cases both matter: a table that always says "raise" must fail
    outcomes = collections.Counter(run(c).raised for c in CASES if c.family == "matmul")
    assert outcomes[True] >= 20 and outcomes[False] >= 20


def test_allow_list_is_small_and_real() -> None:
    assert len(ALLOWED) <= 3
    ids = {c.id for c in CASES}
    assert set(ALLOWED) <= ids


def test_table_agreement_is_at_least_95_percent() -> None:
    agree = sum(predict(c) == run(c) for c in CASES)
    assert agree / len(CASES) >= 0.95, f"agreement {agree}/{len(CASES)}"


def test_fake_kernels_alone_miss_what_the_table_catches() -> None:
    # the measured gap the table exists for: a fake linear(f32, bf16 weight) returns f32
    from .contract_cases import run_fake

    wanted = (
        "linear[f32-bf16-none]",
        "addmm[f32-bf16-bf16]",
        "native_layer_norm[f32-bf16-bf16]",
        "index_put[f32-bf16]",
        "convolution[bf16-f32-none]",
    )
    gap = [c for c in CASES if c.id in wanted]
    assert len(gap) == 5
    for case in gap:
        assert run(case).raised
        assert predict(case).raised
        assert not run_fake(case).raised


def test_every_missing_kernel_rule_is_measured_both_ways() -> None:
    # each "no bf16/f16 kernel" rule has a case the real kernel refuses and, for CPU rules, one
    # it accepts (f32), so a rule that refuses too much or too little fails above
    from castwise.trace.contracts import _NO_KERNEL

    refused: set[str] = set()
    accepted: set[str] = set()
    for case in CASES:
        if case.family != "nokernel":
            continue
        packet = f"aten.{case.func._opname}"
        overload = f"{packet}.{case.func._overloadname}"
        key = overload if overload in _NO_KERNEL else packet
        (refused if run(case).raised else accepted).add(key)
    cpu_rules = {k for k, spec in _NO_KERNEL.items() if spec.cpu is not None}
    assert cpu_rules <= refused, sorted(cpu_rules - refused)
    assert cpu_rules <= accepted, sorted(cpu_rules - accepted)
