"""The zoo on real CUDA kernels (gpu marker): the simulated-CUDA audit a user without a GPU runs
(fake tensors, ``device="cuda"``) must agree with the same model run for real on a CUDA device:
every real failure detected, no error finding where the real CUDA run passes, no crash.

A handful of models from each library family, in the situations whose CUDA rules differ most
from the CPU's (autocast to f16 and bf16, whole-model f16, norms kept f32 by hand). The whole zoo:
``python benchmarks/bench_zoo_cuda.py`` on a GPU machine.
"""

from __future__ import annotations

import pytest
from benchmarks.bench_zoo_cuda import evaluate
from benchmarks.zoo import models
from benchmarks.zoo.cases import Case, quiet

pytestmark = pytest.mark.gpu

WANTED = ("nn_mlp", "nn_convnet", "nn_transformer_encoder", "llama", "bert", "t5", "timm_resnet", "tv_resnet")
SITUATIONS = ("bf16-mixed", "16-mixed", "16-true", "bf16-hand-norms-fp32")
AVAILABLE = {m.name for m in models.models()}
CASES = [Case(name, s, None, 0) for name in WANTED if name in AVAILABLE for s in SITUATIONS]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.model}-{c.situation}" for c in CASES])
def test_simulated_cuda_audit_agrees_with_real_cuda_run(case: Case) -> None:
    quiet()
    record = evaluate(case, timeout=300)
    s = record["score"]
    assert not s["crash"], record
    assert not s["missed"], f"real CUDA run failed, audit missed it: {record['real']}"
    assert not s["false_alarm_modes"], f"audit says {record['codes']} where the real CUDA run passed"
    assert not s["incomplete_ok"]


def test_enough_zoo_models_are_installed() -> None:
    assert len(CASES) >= 5 * len(SITUATIONS)
