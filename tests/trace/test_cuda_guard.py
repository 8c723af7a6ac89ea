"""Simulated CUDA on every torch build: the stand-in CUDA device guard (trace/cuda_guard.py).

The runs go in a subprocess: on a build without a CUDA guard, autograd's first fake CUDA node
kills the process (SIGABRT), which would take pytest with it. A CPU-only build is reproduced on
any build by emptying the CUDA slot of c10's guard registry, which is all a CPU-only build lacks
here; run this file under a CPU-only torch to check the real thing (docs/torch.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from castwise.trace import cuda_guard

# what a CPU-only build looks like to autograd: no guard in the CUDA slot (c10::DeviceType::CUDA == 1)
_NO_CUDA_GUARD = """
import ctypes, os, torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
head = ctypes.c_void_p.in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")
(ctypes.c_void_p * 2).from_address(ctypes.addressof(head))[1] = None
"""

_AUDIT = """
import castwise
from torch import nn
model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
report = castwise.audit(model, torch.randn(4, 8), policy="bf16-mixed", device="cuda", mode="train")
print([(r.mode, r.device, r.status) for r in report.runs])
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=300
    )


def test_simulated_cuda_trains_on_this_build() -> None:
    done = _run("import torch\n" + _AUDIT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[('train', 'cuda', 'ok')]" in done.stdout


def test_simulated_cuda_trains_without_a_cuda_guard() -> None:
    # before the stand-in: SIGABRT, "PyTorch is not linked with support for cuda devices"
    done = _run(_NO_CUDA_GUARD + _AUDIT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[('train', 'cuda', 'ok')]" in done.stdout


def test_unreachable_registry_is_a_castwise_error_not_an_abort() -> None:
    # a build whose libc10 castwise cannot read (Windows): a CUDA build from 2.13 on has torch's
    # own no-op guard to fall back on; a CPU-only build gets castwise's error, never an abort
    done = _run(
        "import torch\nimport castwise.trace.cuda_guard as g\ng._REGISTRY_SYMBOL = 'not_in_this_build'\n"
        + "try:\n"
        + textwrap.indent(_AUDIT, "    ")
        + "except castwise.errors.CudaSimulationError as exc:\n    print('refused:', exc)\n"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    if torch.cuda._is_compiled():
        assert "[('train', 'cuda', 'ok')]" in done.stdout
    else:
        assert "refused: torch " in done.stdout
        assert "device='cpu'" in done.stdout


def test_the_cuda_slot_is_restored() -> None:
    slots = cuda_guard.guard_registry()
    assert slots is not None  # reachable on Linux and macOS builds
    before = slots[1]
    try:
        with cuda_guard.stand_in_guard():
            if not torch.cuda.is_available():
                assert slots[1] == slots[14]  # the meta device's no-op guard stands in
            raise KeyError("inside")
    except KeyError:
        pass
    assert slots[1] == before
