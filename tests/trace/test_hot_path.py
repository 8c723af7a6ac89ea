"""The tracer's per-op shortcuts give the answers the long way gives.

The handler runs for every op of an audit, so it caches what it can: each op's fixed facts
(``trace/opinfo.py``), its contract per device (``contracts.lookup``), and it skips rules that
cannot refuse. A fake run's few real kernels run on one thread. Each shortcut is checked here
against what it stands for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import castwise
from castwise import devices
from castwise.trace import contracts
from castwise.trace.contracts import Violation
from castwise.trace.observers import Observer, OpCall
from castwise.trace.opinfo import info_of

from .contract_cases import all_cases

aten = torch.ops.aten


def test_op_facts_are_the_ops_own() -> None:
    assert info_of(aten.addmm.default) is info_of(aten.addmm.default)  # cached, one object
    assert info_of(aten.addmm.default).name == "aten.addmm"
    assert info_of(aten._local_scalar_dense.default).scalar and info_of(aten.is_nonzero.default).scalar
    assert not info_of(aten.add.Tensor).scalar
    assert info_of(aten._to_copy.default).to_copy and not info_of(aten.to.dtype).to_copy
    assert info_of(aten.view.default).is_view and not info_of(aten.mm.default).is_view
    assert info_of(aten._native_multi_head_attention.default).fused
    assert info_of(aten._transformer_encoder_layer_fwd.default).fast


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_one_lookup_answers_what_check_and_is_covered_answer(device: str) -> None:
    dev = devices.get(device)
    for case in all_cases():
        args, kwargs = case.make()
        found = contracts.lookup(case.func, dev)
        assert found is contracts.lookup(case.func, device)  # cached per (op, device)
        assert found.covered == contracts.is_covered(case.func), case.id
        out = found.outcome(args, kwargs)
        violation = out if isinstance(out, Violation) else None
        assert found.check(args, kwargs) == violation, case.id
        assert contracts.check(case.func, args, kwargs, dev) == violation, case.id
        assert contracts.result_dtype(case.func, args, kwargs, dev) == (
            out if isinstance(out, torch.dtype) else None
        ), case.id


def test_rules_a_check_skips_never_refuse() -> None:
    # the skip is sound only while those rules never answer with a Violation: run them anyway
    skipped = 0
    for device in ("cpu", "cuda"):
        for case in all_cases():
            found = contracts.lookup(case.func, device)
            if found.rule is None or found.refuses:
                continue
            skipped += 1
            args, kwargs = case.make()
            assert not isinstance(found.outcome(args, kwargs), Violation), case.id
    assert skipped > 0


def test_an_unknown_op_is_uncovered_and_makes_no_claim() -> None:
    found = contracts.lookup(aten.lgamma_.default, "cpu")
    assert not found.covered and found.rule is None
    assert found.check((torch.ones(2),), {}) is None


class _Threads(Observer):
    name = "threads"

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def check(self, call: OpCall) -> None:
        self.seen.add(torch.get_num_threads())


class _Mask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool).tril()  # a real shadow kernel
        return x.masked_fill(~keep, 0.0)


def test_a_fake_run_uses_one_thread_and_gives_the_callers_back() -> None:
    from castwise.auditor.session import run_audit

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        observer = _Threads()
        report, _runs = run_audit(_Mask(), torch.randn(1, 4, 4), None, "cpu", "eval", True, observers=[observer])
        assert observer.seen == {1}
        assert torch.get_num_threads() == 2
        assert report.runs[0].status == "ok"
    finally:
        torch.set_num_threads(before)


def test_a_real_run_keeps_the_callers_threads() -> None:
    from castwise.auditor.session import run_audit

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        observer = _Threads()
        run_audit(_Mask(), torch.randn(1, 4, 4), None, "cpu", "eval", False, observers=[observer])
        assert observer.seen == {2}
    finally:
        torch.set_num_threads(before)


class _Tagged(torch.Tensor):
    """A subclass whose torch functions count their calls: the model's own use still reaches it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


def test_subclass_torch_functions_still_run_in_the_models_code() -> None:
    # the tracer reads metadata with them off, only inside its own handler
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4).as_subclass(_Tagged)
    _Tagged.calls = 0
    report = castwise.audit(model, x, device="cpu", fake=False, mode="eval")
    assert _Tagged.calls > 0
    assert report.runs[0].status == "ok"


class _Ops(Observer):
    """Each op's (phase, module, op) and its outputs, as an observer that needs no provenance."""

    needs: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []
        self.outs: list[torch.Tensor] = []

    def after(self, call: OpCall, outputs: list[torch.Tensor]) -> None:
        self.seen.append((call.phase, call.module, call.name))
        self.outs.extend(outputs)


class _OpsWithProvenance(_Ops):
    needs = frozenset({"provenance"})


def test_a_run_whose_observers_need_no_provenance_skips_it_and_keeps_module_attribution() -> None:
    from castwise.trace.tracer import Tracer, run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    runs = {}
    for observer in (_Ops(), _OpsWithProvenance()):
        tracer = Tracer(model, "cpu", fake=False, record_ops=False, observers=[observer])
        run(tracer, model, (x,), {}, "train", engine_backward=True)
        model.zero_grad()
        runs[type(observer).__name__] = (tracer, observer)
    lean, lean_obs = runs["_Ops"]
    full, full_obs = runs["_OpsWithProvenance"]
    assert not lean.provenance and full.provenance
    # the same ops on the same modules, forward and backward (backward through the nodes' tags)
    assert lean_obs.seen == full_obs.seen
    assert ("backward", "0", "aten.mm") in lean_obs.seen or ("backward", "2", "aten.mm") in lean_obs.seen
    assert all(lean.prov_of(t) is None for t in lean_obs.outs)
    assert all(full.prov_of(t) is not None for t in full_obs.outs if t.dtype.is_floating_point)
    # an observer that declares nothing keeps the default: provenance on
    assert Tracer(model, "cpu", fake=False, observers=[Observer()]).provenance
