"""Auditing never changes the model or any global state: every story, every mode, also when the
model raises, also when the caller runs under autocast / no_grad / another default dtype."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.modules import module as module_mod

import castwise
from castwise._autocast import AutocastState
from castwise.stories import STORIES
from castwise.trace import simcuda


def model_state(model: nn.Module) -> dict[str, Any]:
    tensors = []
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            grad = t.grad
            tensors.append(
                (
                    kind,
                    name,
                    id(t),
                    t.dtype,
                    t.device,
                    t.requires_grad,
                    t._version,
                    t.data_ptr() if t.device.type != "meta" else None,
                    None if grad is None else (id(grad), grad._version, grad.dtype),
                )
            )
    modules = [
        (
            name,
            type(m),
            m.training,
            dict(m._forward_hooks),
            dict(m._forward_pre_hooks),
            dict(m._backward_hooks),
            dict(m._backward_pre_hooks),
            m.__dict__.get("forward"),
        )
        for name, m in model.named_modules()
    ]
    return {"tensors": tensors, "modules": modules}


def values(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def global_state() -> dict[str, Any]:
    import torch.autograd as autograd_pkg

    registries = {
        name: dict(getattr(module_mod, name))
        for name in dir(module_mod)
        if name.startswith("_global_") and isinstance(getattr(module_mod, name), dict)
    }
    return {
        "autocast": AutocastState.capture(),
        "autocast_nesting": (torch.autocast_increment_nesting(), torch.autocast_decrement_nesting()),
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "fastpath": torch.backends.mha.get_fastpath_enabled(),
        "registries": registries,
        "engine": autograd_pkg._engine_run_backward,
        "fake_log": logging.getLogger("torch._subclasses.fake_tensor").level,
        "rng": torch.get_rng_state().numpy().tobytes(),
        "cudnn": (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        # what a simulated CUDA run answers model code, and what torch caches or queues from it
        "cuda": {name: getattr(torch.cuda, name) for name in simcuda.PATCHED},
        "checkpoint_device": torch.utils.checkpoint.DefaultDeviceType._default_device_type,
        "cuda_queued": (len(torch.cuda._queued_calls), torch.cuda._lazy_seed_tracker.get_calls()),
    }


CASES = [(story.number, mode) for story in STORIES for mode in ("train", "eval")]


@pytest.mark.parametrize(("number", "mode"), CASES, ids=[f"story{n}-{m}" for n, m in CASES])
def test_audit_leaves_model_and_globals_as_they_were(number: int, mode: str) -> None:
    story = STORIES[number - 1]
    model, inputs = story.build()
    model.train(mode == "eval")  # the opposite of what the audit sets on its copy
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    before, globals_before = model_state(model), global_state()
    small = sum(p.numel() for p in model.parameters()) < 5_000_000
    vals = values(model) if small else None
    castwise.audit(model, inputs, policy=story.policy, device=story.device, mode=mode)
    assert model_state(model) == before
    assert global_state() == globals_before
    if vals is not None:
        assert all(torch.equal(a, b) for a, b in zip(vals, values(model), strict=True))


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.backends.mha.set_fastpath_enabled(False)  # a model that changes global state...
        torch.set_default_dtype(torch.float64)
        h = self.lin(x)
        raise ValueError("boom")  # ...and raises before it can restore it
        return h


@pytest.mark.parametrize("fake", [True, False])
def test_a_raising_model_changes_nothing_even_under_a_callers_autocast(fake: bool) -> None:
    model = Raises()
    hook_calls: list[str] = []
    model.lin.register_forward_hook(lambda m, a, o: hook_calls.append("user hook"))
    before = model_state(model)
    vals = values(model)
    x = torch.randn(2, 4)  # before the state is taken: drawing it moves the random stream
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        inside = global_state()
        report = castwise.audit(model, x, mode="both", fake=fake)
        assert global_state() == inside
    assert [f.code for f in report.errors] == ["CW130"]
    assert report.errors[0].modes == ("train", "eval")
    assert "ValueError: boom" in report.errors[0].message
    assert model_state(model) == before
    assert all(torch.equal(a, b) for a, b in zip(vals, values(model), strict=True))
    assert torch.get_default_dtype() == torch.float32
    assert torch.backends.mha.get_fastpath_enabled()


def test_default_dtype_and_fastpath_of_the_caller_are_kept() -> None:
    model, inputs = STORIES[2].build()
    torch.set_default_dtype(torch.float64)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        state = global_state()
        castwise.audit(model, inputs, policy="bf16-mixed", mode="eval")
        assert global_state() == state
    finally:
        torch.set_default_dtype(torch.float32)
        torch.backends.mha.set_fastpath_enabled(True)


@pytest.mark.parametrize("fake", [True, False])
def test_a_real_audit_does_not_advance_the_callers_random_stream(fake: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))  # dropout draws from the global generator
    x = torch.randn(2, 4)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    before = global_state()
    castwise.audit(model, x, mode="both", fake=fake)
    assert global_state() == before
    assert torch.equal(torch.rand(3), expected)


def test_a_simulated_cuda_rnn_audit_leaves_cudnn_flags_as_they_were() -> None:
    model, x = nn.GRU(4, 8), torch.randn(3, 2, 4)
    before = global_state()
    castwise.audit(model, x, device="cuda")
    assert global_state() == before
