"""Differential test of the dtype-contract table against real CPU kernels.

Every case in contract_cases.py calls one aten overload on tiny real CPU tensors; the table must
predict the outcome: whether the kernel raises, and the dtype it returns when it does not. When
both raise, the table's message must be the kernel's own (first line), and the violation must
point at operands that really have a dtype other than the one it says the kernel wanted.

CPUs differ (an AVX2 CPU runs bf16 convolutions on native kernels, an AVX-512 one on oneDNN), so
the table is checked for *this machine's* CPU (``devices.host_cpu()``, capabilities read from the
torch build) against its live kernels, and for every CPU class with recorded truth
(tests/trace/truth/, kernel_truth.py) against that record.
"""

from __future__ import annotations

import collections

import pytest
import torch

from castwise import devices
from castwise.devices import Device
from castwise.trace import contracts
from castwise.trace.contracts import check, tensor_args

from . import kernel_truth
from .contract_cases import Case, Outcome, all_cases, predict, run, run_detail

CASES = all_cases()


@pytest.fixture(autouse=True)
def _strict_contracts(monkeypatch: pytest.MonkeyPatch) -> None:
    # a rule that raises on a case is a bug to see here, not a silent "no claim"
    monkeypatch.setattr(contracts, "_STRICT", True)


HOST = devices.host_cpu()

# Cases where the table knowingly differs from this machine's CPU kernels, and why (none today:
# the oneDNN-only gelu_backward failure that was here is a rule of the cpu.onednn path now).
ALLOWED: dict[str, tuple[Outcome, str]] = {}

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
    predicted = predict(case, HOST)
    if case.id in ALLOWED:
        want, _why = ALLOWED[case.id]
        assert predicted == want
        return
    real, message = run_detail(case)
    assert predicted == real, f"{case.id}: real CPU kernel ({HOST.caps}) -> {real} ({message}), table -> {predicted}"
    _check_violation(case, HOST, real, message)


def _check_violation(case: Case, dev: Device, real: Outcome, message: str | None) -> None:
    """The table's refusal worded as the kernel's and naming operands really at fault."""
    if not real.raised:
        return
    args, kwargs = case.make()
    violation = check(case.func, args, kwargs, dev)
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


# ---------------------------------------------------------------------------------------------
# truth per CPU class: recorded on real kernels (kernel_truth.py), checked on any machine

RECORDED = kernel_truth.recorded()


def test_truth_is_recorded_for_the_cpu_classes_ci_runs_on() -> None:
    # CI machines are AVX2 or AVX-512 CPUs: both classes must have measured truth for this torch
    # (record with `python -m tests.trace.kernel_truth [--emulate cpu:avx2]`)
    if kernel_truth.torch_minor() in ("2.10", "2.11", "2.12", "2.13", "2.14", "2.15"):  # measured (docs/torch.md)
        assert {"cpu:avx2", "cpu:avx512"} <= set(RECORDED)
    for variant, data in RECORDED.items():
        assert devices.get(variant).caps is not None
        assert set(data["cases"]) == {c.id for c in CASES}, f"{variant}: re-record, the cases changed"


@pytest.mark.parametrize("variant", sorted(RECORDED))
def test_table_predicts_each_recorded_cpu_class(variant: str) -> None:
    dev = devices.get(variant)
    truth = RECORDED[variant]["cases"]
    wrong = []
    for case in CASES:
        predicted = predict(case, dev)
        if case.id not in ALLOWED and str(predicted) != truth[case.id]["outcome"]:
            wrong.append(f"{case.id}: recorded {truth[case.id]['outcome']}, table {predicted}")
            continue
        real = Outcome(True, None) if truth[case.id]["outcome"] == "raise" else predicted
        _check_violation(case, dev, real, truth[case.id]["message"])
    assert not wrong, f"{variant}: {len(wrong)} cases differ:\n" + "\n".join(wrong[:20])


@pytest.mark.parametrize("variant", sorted(RECORDED))
def test_recorded_truth_is_what_the_kernels_do(variant: str) -> None:
    """A record stays true: this machine measures its own class live, and any class it can emulate
    by capping its kernels; a class it can do neither for is checked by its own machines."""
    host = devices.host_variant()
    truth = {k: v["outcome"] for k, v in RECORDED[variant]["cases"].items()}
    if variant == host:
        live = {c.id: str(run(c)) for c in CASES}
    elif variant in kernel_truth.CAN_EMULATE.get(host or "", ()):
        measured = kernel_truth.measure_emulated(variant)["cases"]
        live = {k: v["outcome"] for k, v in measured.items()}
    else:
        live = truth  # recorded elsewhere, and checked against the table above
        assert HOST.caps != devices.get(variant).caps
    changed = sorted(k for k in truth if truth[k] != live.get(k))
    assert not changed, f"{variant}: {len(changed)} cases changed, e.g. {changed[:5]}; re-record them"


def test_the_host_cpu_is_read_from_the_torch_build() -> None:
    caps = HOST.caps
    assert caps is not None
    assert caps.isa == torch.backends.cpu.get_cpu_capability()
    assert caps.onednn_bf16 == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    # the path a bf16 convolution takes is what torch itself decides on this machine
    x, w = torch.randn(1, 2, 5, 5).bfloat16(), torch.randn(3, 2, 3, 3).bfloat16()
    try:
        torch.ops.aten.convolution(x, w, torch.randn(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        native = True
    except RuntimeError:
        native = False
    assert (HOST.path("bfloat16") == "cpu.native") == native
